"""TensorRT-RTX side of the `ddtree` nodes: Python IPluginV3 creators (creators.py), the symlink-fixing
importer of the RTX wheels (loader.py), plugin fields <-> node attributes (fields.py), and what each
plugin's enqueue launches (kernels.py). Importing this package needs nothing; importing creators.py
needs the `trt` extra (pip install -e '.[trt]')."""
