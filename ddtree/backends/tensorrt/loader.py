"""Import the TensorRT-RTX wheels, creating the library link their ONNX parser needs.

The parser dlopens `libtensorrt_rtx.so` when it imports a plugin node, but the
tensorrt-rtx-cu13-libs wheel ships only `libtensorrt_rtx.so.1`; without the link the process aborts
("terminate called without an active exception", docs/tensorrt-rtx.md section 1). The link must sit
beside the library the bindings load (the parser's RPATH is $ORIGIN): a copy elsewhere is a second
library and breaks the build. `import_trt()` creates it if missing (once per install, said on
stderr) and refuses a link that points at another file.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

INSTALL = "pip install -e '.[trt]' (tensorrt-rtx-cu13-libs and tensorrt-rtx-cu13-bindings)"
LIBRARY, LINK = "libtensorrt_rtx.so.1", "libtensorrt_rtx.so"


class TrtUnavailable(ImportError):
    """The TensorRT-RTX wheels are missing or unusable; the message says what to do."""


def ensure_parser_link(libs_dir: Path) -> Path:
    """libs_dir/libtensorrt_rtx.so -> libtensorrt_rtx.so.1, created if missing."""
    library, link = libs_dir / LIBRARY, libs_dir / LINK
    if not library.is_file():
        raise TrtUnavailable(f"{library}: missing from the tensorrt-rtx-cu13-libs wheel; reinstall: {INSTALL}")
    if link.exists() or link.is_symlink():
        if not (link.exists() and os.path.samefile(link, library)):
            raise TrtUnavailable(f"{link}: exists but is not {library.name}; remove it so ddtree can link it "
                                 f"(a second copy of the library breaks the ONNX parser)")
        return link
    try:
        link.symlink_to(LIBRARY)
    except OSError as e:
        raise TrtUnavailable(f"{link}: cannot create the link the TensorRT-RTX ONNX parser needs ({e}); run: "
                             f"ln -s {LIBRARY} {link}") from e
    print(f"ddtree: created {link} -> {LIBRARY} (the TensorRT-RTX ONNX parser loads it by that name)",
          file=sys.stderr)
    return link


def import_trt():
    """The tensorrt_rtx_bindings module, after loading the libs wheel and fixing the parser link."""
    try:
        import tensorrt_rtx_libs  # tensorrt_rtx: the trt extra (its absence is answered below)
    except ImportError as e:
        raise TrtUnavailable(f"TensorRT-RTX is not installed: {INSTALL}") from e
    ensure_parser_link(Path(tensorrt_rtx_libs.__file__).resolve().parent)
    try:
        import tensorrt_rtx_bindings as trt  # tensorrt_rtx: the trt extra (its absence is answered below)
    except ImportError as e:
        raise TrtUnavailable(f"the TensorRT-RTX bindings do not import ({e}): {INSTALL}") from e
    return trt
