"""The engine directory: its layout, config.json, manifest.json, the load-time check, the loader of one
rank's tensors and the tuning file (layout.py, manifest.py, verify.py, tensors.py, tuning.py; every name is
reachable as ddtree.engine_dir.X).

Written by ddtree/builder, read by ddtree/runtime and ddtree/ops (docs/architecture.md). Every path in
an engine is made here, so no other module spells "rank<r>" or "kernels/<arch>" itself.

    engines/<name>/
      config.json                  {"format": "ddtree-engine/1", "model": <target config.json>,
                                    "drafter": <drafter config.json>, "tp", "experts", "archs", "budgets",
                                    "block_size", "dtypes", "plan" (per-rank sizes, builder/plan.py),
                                    "ranks", "weight_files", "kernels", "tokenizer", "source", ...}
      rank<r>/*.safetensors        that rank's weights (builder/weights.py documents every name and shape)
      rank<r>/<kind>.plan          TensorRT-RTX plans (ddtree-build --trt), listed in plans.json
      graphs/index.json            the graphs of every rank (backends/onnx_export.py)
      graphs/rank<r>/<kind>.onnx   each rank's share of each layer kind
      kernels/<arch>/              cubins, one per kernel source
      tokenizer/                   the checkpoint's tokenizer files (absent for byte-tokenizer models)
      plans.json                   the plans with their inputs and outputs (builder/trt_build.py)
      manifest.json                size and sha256 of every other file (checked by `ddtree inspect`)
      tuning.json                  optional, machine-specific: step times and calibration for `--budget auto`
                                   (written by `ddtree tune`; not in the manifest, its own checksum; tuning.py)

config.json is checked field by field on both sides: the builder cannot write, and the runtime will
not read, one that misses a required field or holds one of the wrong type.
manifest.json: {"format": "ddtree-engine/1", "files": {"config.json": {"size": 1234, "sha256": "..."}, ...},
"files_sha256": sha256 of the "files" object as canonical JSON (so a damaged manifest is named as such; engines
written before it have none)} with relative paths (forward slashes), sorted; files are hashed in 1 MiB reads on a
few threads (hashlib releases the GIL on large buffers).

Loading an engine (runtime/engine_executor.py, runtime/graph_ranks.py) and `ddtree inspect` share one check
(`check_engine`, `engine_problems`), run before the first token:
  structural, always: the manifest well formed; every file it lists present with its size, nothing unlisted;
    config.json consistent with itself, its plan, the rank directories, the manifest and the weights' headers
    (tp == plan tp == rank directories, weight_files in every rank, the plan's per-rank sizes and every
    tensor's shape recomputed from the model and drafter configs): an edited config is named, field and value.
  hashes (skipped by `ddtree run --skip-verify`): every file's sha256; the rank weight files are hashed while
    load_rank_tensors reads them (one read), the others (cubins, graphs, plans, tokenizer, config) up front.
"""
from __future__ import annotations

from ddtree.engine_dir.layout import (  # noqa: F401
    CONFIG,
    DRAFTER_PREFIX,
    ENGINE_FORMAT,
    EXPERT_MODES,
    EXPERT_STACKS,
    FORMAT_FAMILY,
    GRAPHS,
    HASH_THREADS,
    KERNELS,
    MANIFEST,
    PACKED_SUFFIXES,
    PLANS,
    READ_BYTES,
    REQUIRED,
    TOKENIZER,
    TUNING,
    WEIGHT_SUFFIX,
    EngineFormatError,
    check_engine_config,
    config_path,
    engine_configs,
    graph_rel,
    graphs_dir,
    graphs_index_path,
    graphs_rank_dir,
    is_engine_dir,
    kernels_dir,
    kernels_rel,
    manifest_path,
    not_an_engine,
    plan_rel,
    plans_path,
    rank_dir,
    rank_name,
    read_engine_config,
    tokenizer_dir,
    write_engine_config,
)
from ddtree.engine_dir.manifest import (  # noqa: F401
    MANIFEST_FIELDS,
    SHA256_HEX,
    engine_files,
    files_checksum,
    read_manifest,
    sha256_file,
    verify_manifest,
    write_manifest,
)
from ddtree.engine_dir.tensors import BFLOAT16, STORED, load_rank_tensors  # noqa: F401
from ddtree.engine_dir.tuning import (  # noqa: F401
    TUNING_FORMAT,
    Tuning,
    TuningError,
    describe_tuning,
    read_tuning,
    tuning_path,
    tuning_problems,
    write_tuning,
)
from ddtree.engine_dir.verify import (  # noqa: F401
    PLAN_SOURCES,
    check_engine,
    config_problems,
    engine_problems,
    plan_all_reduce_counts,
    plan_per_rank,
)
