"""`python -m ddtree ...` is the `ddtree` command."""
from ddtree.cli import main

main()
