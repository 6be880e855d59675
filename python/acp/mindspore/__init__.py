"""MindSpore support: parameter dicts, in-place loads, a ``Model.train``
callback, resume, and conversion to and from MindSpore's own formats.

Importing this module imports MindSpore; ``import acp`` never does. The
codec imports it by itself when a state holds a MindSpore tensor, so
``ckpt.save(step, {"w": parameter})`` works without importing it first.

Tensors. MindSpore's ``float64`` to ``bool_``, ``bfloat16``, ``float16``,
``float8_e4m3fn``, ``float8_e5m2`` and ``complex64`` are stored;
MindSpore-only types (``complex128``, ``hifloat8``, ``int4``) are refused
naming the key, and so is a load of a tensor whose dtype MindSpore lacks
(torch's ``float8_e8m0fnu``, say). On the CPU a tensor's memory is its host memory: ``data_ptr()``
is handed to the engine, which copies it into the ring slot with the GIL
released (no ``asnumpy()``, no extra copy); a non-contiguous view is first
made contiguous. A tensor on a device (Ascend, GPU) is brought to the host
with ``asnumpy()`` first; bf16 and fp8 go through an unsigned view of the
same width, since NumPy has no such types. ``Parameter`` names and
``requires_grad`` come back with the parameters.

Networks. ``param_dict(net, optimizer)`` is what ``mindspore.save_checkpoint``
saves: every parameter by its ``name``. ``save`` writes
``{"params": param_dict(...), **values}``; ``load_into_net`` copies a
checkpoint in place into an existing network and optimizer, straight from
the resident ring slot into the parameters' memory, and reports
``param_not_load`` / ``ckpt_not_load`` the way
``mindspore.load_param_into_net`` does (prefix matching and float/int type
conversion included unless ``strict_load``). ``AcpCheckpoint`` saves from
``Model.train``; ``resume`` restores a network, optimizer and the epoch.

Conversion. ``export_ckpt`` writes any acp checkpoint as a MindSpore
``.ckpt`` or ``.safetensors`` file; ``import_ckpt`` reads one into a
checkpoint.
"""

from __future__ import annotations

from acp._mindspore_codec import DTYPES, Adapter, dtype_from_safetensors, dtype_to_safetensors
from acp.mindspore.callback import AcpCheckpoint
from acp.mindspore.conversion import export_ckpt, import_ckpt, write_ckpt
from acp.mindspore.network import (
    NetLoad,
    Resume,
    load_into_net,
    load_params,
    rank_and_world_size,
    resume,
)
from acp.mindspore.params import PARAMS, check_param_dict, param_dict, save, state_dict

__all__ = [
    "DTYPES",
    "PARAMS",
    "AcpCheckpoint",
    "Adapter",
    "NetLoad",
    "Resume",
    "check_param_dict",
    "dtype_from_safetensors",
    "dtype_to_safetensors",
    "export_ckpt",
    "import_ckpt",
    "load_into_net",
    "load_params",
    "param_dict",
    "rank_and_world_size",
    "resume",
    "save",
    "state_dict",
    "write_ckpt",
]
