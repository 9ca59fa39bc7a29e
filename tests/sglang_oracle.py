"""SGLang 0.5.23's own code as a judge of what we send it, run in a process of its own.

    python tests/sglang_oracle.py < jobs.pickle > answers.pickle

Each job is a tuple; each answer ``("ok", value)`` or ``("error", "Type: message")``:

* ``("decode", entry)``: one ``serialized_named_tensors`` entry as SGLang's scheduler reads it:
  ``normalize_serialized_named_tensor_payloads`` (``srt/utils/common.py:3109-3132``, the tokenizer
  side), ``monkey_patch_torch_reductions`` and ``MultiprocessingSerializer.deserialize`` under its
  ``SafeUnpickler`` (``srt/managers/tp_worker.py:194-201``).
* ``("decode_flattened", entry)``: the same, then the named tensors a ``flattened_bucket`` entry
  becomes (``FlattenedTensorBucket``, ``srt/weight_sync/tensor_bucket.py``), each as ``(name,
  dtype, shape, its bytes)``.
* ``("decode_cuda_handle", entry, uuids)``: a by-reference entry (CUDA IPC handles naming their GPU
  by UUID) decoded as in ``decode`` on a machine whose GPUs have ``uuids``; CUDA is faked, and
  torch's own rebuild of a handle (it needs a GPU) records the arguments SGLang's patched
  rebuild (``srt/utils/patch_torch.py``) hands it: the answer.
* ``("receive_layout", names, dtypes, shapes)``: the buffer layout a server receives an announced
  flattened bucket into (``FlattenedTensorBucket.empty``), or its refusal.
* ``("validate", struct, body)``: the request body as FastAPI validates it into the
  ``srt/managers/io_struct.py`` definition named ``struct``; the value is the declared field names
  and the parsed values.
* ``("contract", body)``: the ``/generate`` JSON contract gate (``srt/entrypoints/api_contract.py``):
  None or its error text.
* ``("allowed_globals",)``: ``SafeUnpickler.ALLOWED_GLOBALS``.
* ``("triton_names",)``: the names SGLang's imported modules set on and read from the ``triton``
  placeholder (ask it last: it reports what every earlier job touched).

Only SGLang's pure modules are imported, from the package installed by ``pip install --no-deps
-r tests/requirements-sglang.txt``: its ``__init__`` (transformers patches, the frontend) is
skipped by registering a bare package; ``triton``, imported at the top of ``srt/utils/common.py``
but only used inside functions (``:91``), is an empty placeholder unless installed, refusing every
name read from it (``("triton_names",)``: what the imported modules set and read); ``io_struct``'s one
heavy import, ``schedule_batch`` (which reaches the GPU runtime), is replaced by the five names
``io_struct.py:58-64`` takes from it, the two used in request fields copied exactly
(``schedule_batch.py:179-180``). Its own process, because SGLang's torch patches and these
placeholders must not leak into the test process.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import pickle
import sys
import types
from typing import Literal, Union


def bootstrap() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise SystemExit("sglang is not installed: pip install --no-deps -r tests/requirements-sglang.txt")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["sglang"] = package
    if importlib.util.find_spec("triton") is None:
        # An empty module: the modules we import only set ``triton.next_power_of_2``
        # (``srt/utils/common.py:3701``); any name they read is refused and recorded (``triton_names``).
        triton = types.ModuleType("triton")
        triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)

        def refuse(name):
            if not name.startswith("__"):
                TRITON_READS.append(name)
            raise AttributeError(f"the triton placeholder has no {name!r}")

        triton.__getattr__ = refuse
        sys.modules["triton"] = triton


TRITON_READS: list[str] = []
"""Names SGLang's modules read from the triton placeholder and did not find (should stay empty)."""


def triton_names():
    """What SGLang's imported modules did with the placeholder: the names they set, the names they read."""
    triton = sys.modules["triton"]
    return {"set": sorted(n for n in vars(triton) if not n.startswith("__")), "read": sorted(set(TRITON_READS))}


def io_struct():
    import msgspec
    from sglang.srt.multimodal.modality import Modality

    stand_in = types.ModuleType("sglang.srt.managers.schedule_batch")
    stand_in.Modality = Modality

    class MultimodalProcessorOutput(msgspec.Struct, kw_only=True, dict=True, array_like=True):
        input_ids: object = None  # multimodal requests are out of scope

    def get_return_hidden_states_mode(value):
        raise NotImplementedError("schedule_batch stand-in")

    stand_in.MultimodalProcessorOutput = MultimodalProcessorOutput
    stand_in.ReturnHiddenStatesMode = Union[bool, Literal["last"]]  # schedule_batch.py:179
    stand_in.SamplingLogprobsMode = Literal["selected", "support"]  # schedule_batch.py:180
    stand_in.get_return_hidden_states_mode = get_return_hidden_states_mode
    sys.modules[stand_in.__name__] = stand_in
    from sglang.srt.managers import io_struct as module

    return module


def decode(entry):
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    raw = normalize_serialized_named_tensor_payloads([entry])[0]
    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.deserialize(raw)


def decode_cuda_handle(entry, uuids):
    import torch
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.multiprocessing import reductions

    monkey_patch_torch_reductions()
    torch.cuda.device_count = lambda: len(uuids)
    torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(uuid=uuids[index])
    calls = []

    def rebuild(*args):
        calls.append(args)
        return torch.zeros(args[1], dtype=args[5])

    reductions._rebuild_cuda_tensor_original = rebuild
    decode(entry)
    return calls


def decode_flattened(entry):
    """A ``flattened_bucket`` entry as the model runner hands it to the loader: decoded, its metadata
    re-made as ``FlattenedTensorMetadata`` and the tensors rebuilt by ``FlattenedTensorBucket``
    (``_update_weights_from_flattened_bucket``, model runner's ``weight_updater.py:383-411``, whose
    module reaches the GPU runtime; the test reads that function's source)."""
    import torch
    from sglang.srt.weight_sync.tensor_bucket import (
        FlattenedTensorBucket,
        FlattenedTensorMetadata,
    )

    data = decode(entry)
    metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
    named = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata).reconstruct_tensors()
    # As bytes: torch cannot unpickle its own pickling of uint16 tensors in the test process.
    return [(name, str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).clone())
            for name, t in named]


def receive_layout(names, dtypes, shapes):
    """The buffer a server allocates for an announced flattened bucket (``FlattenedTensorBucket.empty``)."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
    return [(m.name, m.dtype, tuple(m.shape), m.start_idx, m.end_idx) for m in bucket.metadata]


def validate(struct: str, body):
    import msgspec
    import pydantic

    cls = getattr(io_struct(), struct)
    parsed = pydantic.TypeAdapter(cls).validate_python(body)
    if dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls)]
    else:
        names = [f.name for f in msgspec.structs.fields(cls)]
    return {"fields": names, "values": {n: getattr(parsed, n) for n in names}}


def contract(body):
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    return generate_contract_error(body)


def sampling_params(params: dict, vocab_size: int):
    """SGLang's own SamplingParams check of a request's ``sampling_params`` (what its scheduler runs)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    checked = SamplingParams(**params)
    checked.verify(vocab_size)
    return {"max_new_tokens": checked.max_new_tokens}


def allowed_globals():
    from sglang.srt.utils.common import SafeUnpickler

    return sorted(SafeUnpickler.ALLOWED_GLOBALS)


def main() -> int:
    bootstrap()
    jobs = pickle.load(sys.stdin.buffer)
    handlers = {"decode": decode, "decode_cuda_handle": decode_cuda_handle,
                "decode_flattened": decode_flattened, "receive_layout": receive_layout,
                "validate": validate, "contract": contract, "allowed_globals": allowed_globals,
                "sampling_params": sampling_params, "triton_names": triton_names}
    answers = []
    for kind, *args in jobs:
        try:
            answers.append(("ok", handlers[kind](*args)))
        except Exception as err:  # noqa: BLE001 - the verdict is the answer
            answers.append(("error", f"{type(err).__name__}: {err}"))
    sys.stdout.buffer.write(pickle.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
