"""The model, written once, as functions over the op set.

    opset.py   the op set: every op a rank performs, with shapes and dtypes (Ops), and a rank's layout
    layers.py  each layer kind as one function over the op set (embed, decoder layer, head, drafter fc /
               layer / head, compact, tree, accept)
    stack.py   the whole model over those functions: the target forward (with taps), the drafter forward,
               the compaction, and the DDTree and AR steps; every executor runs these, none assembles the
               stack itself
    nodes.py   the `ddtree` custom-node table: the ops that the graphs carry as plugin nodes
Nothing here computes: the backends (ddtree/backends) implement the ops, the executors (ddtree/runtime) run
the functions. The float64 oracle (ddtree/reference) is the model's only other copy, written independently."""
