"""Training of the embedded tiny model (issue 5): a Kimi-architecture target and its DFlash drafter.

Everything that imports torch lives in this subpackage and is imported only when training
(`pip install -e '.[train]'`); the rest of ddtree never imports it. Entry point:

    python -m ddtree.training.train --out ddtree/data/tiny --seed 0

Modules: corpus (the pinned stdlib corpus, numpy only), target_model (the target's parameters; its
forward is description/layers.py on the torch backend, ddtree/backends/torch_backend.py), drafter_model (the
drafter's torch twin of ddtree/reference, for its many-blocks-per-sequence objective), export (torch <->
checkpoint files), generate (greedy continuations the drafter learns from, through the same description),
train (the phases), evaluate (bits/byte through the numpy reference).
"""
