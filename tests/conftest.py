"""Shared pytest setup: markers, the GPU skip, and the warnings we accept (one by one).

Every other warning shows in pytest's summary, Megatron-Core's notices of what is about to
change included. An accepted warning is named by the start of its message (a regex), its
category and the module that issues it, with the reason it is expected here.
"""

import os

# Before torch loads libgomp, which reads it once: OpenMP threads sleep as soon as they wait
# rather than spin. Two xdist workers share the 2 cores with the worlds and servers they start
# (all of which inherit this), and spinning threads there only took CPU from one another (see
# megatron_rl.parallel.world.OPENMP_WAIT, which does the same for every world's ranks).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

ACCEPTED_WARNINGS = (
    # (message regex, category, issuing module regex, reason)
    ("Transformer Engine and Apex are not installed", "UserWarning", r"megatron\.core\.",
     "CPU machine: Megatron falls back to the torch implementations these tests exercise"),
    ("Apex is not installed", "UserWarning", r"megatron\.core\.",
     "CPU machine: Megatron's norms fall back to torch (ours are torch.nn.RMSNorm anyway)"),
    ("full scope is deprecated", "UserWarning", r"megatron\.core\.transformer\.transformer_config",
     "0.16.1's TransformerConfig warns about its own default cuda_graph_scope; we set no CUDA graphs"),
    ("The following imports from `dynamic_context.py`", "DeprecationWarning", r"megatron\.core\.inference",
     "0.16.1 imports its own deprecated names inside its package; nothing of ours uses them"),
    ("The 'megatron.core.transformer.custom_layers.transformer_engine'", "DeprecationWarning",
     r"megatron\.core\.transformer\.multi_latent_attention",
     "0.16.1's MLA module imports its own deprecated TE shim; we do not import it"),
    ("`torch.jit.script_method` is deprecated", "DeprecationWarning", r"torch\.jit\._script",
     "torch.utils.mkldnn (imported by torch.compile, which Megatron's fusions call at import) uses it"),
    ("`load_state_dict` is deprecated and will be removed", "FutureWarning",
     r"megatron\.core\.dist_checkpointing\.strategies\.torch",
     "0.16.1's torch_dist loader calls torch's deprecated load_state_dict (0.19.2 calls load)"),
    # megatron-core 0.19.2 only:
    ("Warning. tp_group is None, using default tp group", "DeprecationWarning", r"megatron\.core\.tensor_parallel",
     "0.19.2's own layer constructors omit tp_group; we build no parallel linear ourselves"),
    ("torch.distributed is disabled, unavailable or uninitialized", "UserWarning",
     r"torch\.distributed\.checkpoint\.utils",
     "single-process DCP reads are intended: our checkpoint reader and 0.19.2's loader pass no_dist=True"),
    ("The argument order of load has been changed", "UserWarning", r"torch\.distributed\.checkpoint\.logger",
     "0.19.2's torch_dist loader calls torch.distributed.checkpoint.load(state, reader, ...) positionally"),
    ("Please use DTensor instead and we are deprecating ShardedTensor", "FutureWarning",
     r"megatron_rl\.parallel\.cpu_platform",
     "0.19.2's torch_dist loader builds torch ShardedTensors; the CPU platform's torch-function mode forwards "
     "that call, so the warning names it"),
)


def pytest_configure(config):
    config.addinivalue_line("markers", "parallel: runs gloo worlds of several processes on CPU")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped on CPU-only machines")
    for message, category, module, _reason in ACCEPTED_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{message}:{category}:{module}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
