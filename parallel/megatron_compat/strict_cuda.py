"""Strict CUDA emulation (``parallel.cpu_emulation=strict``): on CPU ranks, fail where a GPU would.

The plain emulation maps every CUDA device to the CPU, so a tensor left on the host looks exactly
like one on the device and a run that passes here can crash at the first GPU step. Strict mode
keeps track of which tensors would live on the GPU and raises what CUDA raises:

- **Residency** is a property of a tensor's storage (views, ``Parameter(t)`` and ``p.data = t``
  share it): storages made for CUDA (a ``cuda`` / ordinal ``device`` argument, ``.cuda()``,
  ``.to("cuda")``, ``torch.cuda.current_device()``) are device storages, and every aten op that
  reads a device tensor makes device outputs (a :class:`TorchDispatchMode`, so code written later
  is checked too). Device tensors report ``device == cuda:0`` and ``is_cuda``, so
  ``torch.zeros(n, device=x.device)`` follows ``x`` as on a GPU.
- **Mixing**: an op given device tensors and a host tensor of one or more dimensions raises
  "Expected all tensors to be on the same device", naming the op (0-dim host tensors are scalars,
  as on CUDA; copies are allowed, as on CUDA). Indexing follows CUDA's own rules
  (:func:`_check_indexing`): a device tensor takes host indices, a host tensor refuses device
  indices, and ``index_put_`` writes into a device tensor only device values or a 0-dim host
  scalar.
- **Collectives** on a group that would be NCCL on GPUs (every group not created with
  ``backend="gloo"``) raise for host tensors, as NCCL does.
- **Host syncs** on device tensors (``.item()``, ``bool()`` / ``int()`` / ``float()``,
  ``.tolist()``, ``.cpu()``, ``nonzero`` and other data-dependent shapes, device -> host copies)
  are counted, not raised: :func:`take_host_syncs` returns the count since the last call.

Values are computed exactly as in plain mode (a ``.cuda()`` is a copy, as on a GPU), so losses
are bit-identical.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_TAG = "_strict_cuda_resident"
_CUDA0 = torch.device("cuda", 0)
_host_syncs = 0
_gloo_groups: set[str] = set()  #: names of groups created with backend="gloo": host tensors allowed

#: ops that may take device and host tensors together on CUDA
_MIXING_ALLOWED = {"aten::copy_", "aten::_to_copy", "aten::set_", "aten::lift_fresh", "aten::detach",
                   "aten::alias", "aten::_has_compatible_shallow_copy_type"}
#: advanced indexing: (self, indices[, values]) checked by CUDA's rules, not the plain mixing rule
_INDEXING = {"aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
#: ops whose output shape depends on the data: a device -> host sync on CUDA
_DATA_DEPENDENT = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                   "aten::unique_dim", "aten::_unique2", "aten::unique_consecutive",
                   "aten::repeat_interleave.Tensor", "aten::equal"}
#: collectives that carry no user data (the tensor is made by c10d itself)
_CONTROL_COLLECTIVES = {"c10d::barrier", "c10d::monitored_barrier_"}


def _leaves(obj, out: list) -> list:
    """The leaves of an op's arguments or results (tensors, lists and tuples of them, dicts of
    keyword arguments), appended to ``out``: ``torch.utils._pytree.tree_flatten`` without its
    node registry, which cost a third of a strict step (every aten op passes through here)."""
    if isinstance(obj, (list, tuple)):
        for x in obj:
            if isinstance(x, (list, tuple, dict)):
                _leaves(x, out)
            else:
                out.append(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            _leaves(x, out)
    else:
        out.append(obj)
    return out


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta-like wrappers)
        return None


def _tag(t: torch.Tensor):
    s = _storage(t)
    return None if s is None else getattr(s, _TAG, None)


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` would live on the GPU."""
    return _tag(t) is True


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` was made on the host by Python code. Tensors made inside C++ kernels (the
    autograd engine's zero-filled gradients, for one) carry no residency until an op with
    device inputs gives them one: they never count as a mix."""
    return _tag(t) is False


def mark(t: torch.Tensor, resident: bool) -> torch.Tensor:
    s = _storage(t)
    if s is not None:
        setattr(s, _TAG, resident)
    return t


def _count_sync() -> None:
    global _host_syncs
    _host_syncs += 1


def take_host_syncs() -> int:
    """Host syncs on device tensors since the last call."""
    global _host_syncs
    n, _host_syncs = _host_syncs, 0
    return n


@functools.lru_cache(maxsize=None)
def _op_names(func) -> tuple[str, str]:
    """(``ns::op.overload``, ``ns::op``) of an op."""
    name = _op_name(func)
    return name, name.split(".")[0]


def _op_name(func) -> str:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return str(func)
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class DeviceResidencyMode(TorchDispatchMode):
    """Propagates residency through every aten op; raises on mixes; counts host syncs; checks
    collectives."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Keep ``__torch_dispatch__`` a plain method: torch otherwise wraps it in
        ``torch._disable_dynamo``, a Python frame around every aten op (a tenth of a strict
        step). Nothing is compiled on CPU ranks (megatron's fusers run eagerly, see
        :mod:`.jit_fusers`), so there is no Dynamo to keep out."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = _leaves(kwargs, _leaves(args, [])) if kwargs else _leaves(args, [])
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        name, base = _op_names(func)
        if base.startswith("c10d::"):
            self._check_collective(base, flat, tensors)
            return func(*args, **kwargs)
        device = [t for t in tensors if on_device(t)]
        if device and name in _INDEXING:
            _check_indexing(name, args)
        elif device:
            host = [t for t in tensors if t.dim() > 0 and on_host(t)]
            if host and base not in _MIXING_ALLOWED and name not in _MIXING_ALLOWED:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two "
                    f"devices, cuda:0 and cpu! (when checking arguments for {name}; host tensor "
                    f"of shape {tuple(host[0].shape)}) [strict CUDA emulation]")
            if base in _DATA_DEPENDENT or name in _DATA_DEPENDENT:
                _count_sync()
            elif base == "aten::copy_" and not on_device(args[0]) and on_device(args[1]):
                _count_sync()
        out = func(*args, **kwargs)
        if device:
            for o in (out,) if isinstance(out, torch.Tensor) else _leaves(out, []):
                if isinstance(o, torch.Tensor) and not (base == "aten::copy_" and o is args[0]):
                    mark(o, True)
        return out

    @staticmethod
    def _check_collective(base: str, flat, tensors) -> None:
        if base in _CONTROL_COLLECTIVES:
            return
        groups = [a for a in flat if isinstance(a, torch.ScriptObject)]
        names = set()
        for g in groups:
            try:
                names.add(dist.ProcessGroup.unbox(g).group_name)
            except (RuntimeError, AttributeError, TypeError):
                pass
        if names & _gloo_groups:
            return
        host = [t for t in tensors if on_host(t)]
        if host:
            raise RuntimeError(
                f"No backend type associated with device type cpu: {base} on a group that is "
                f"NCCL on GPUs got a host tensor of shape {tuple(host[0].shape)} "
                f"[strict CUDA emulation]")


def _check_indexing(name: str, args) -> None:
    """CUDA's rules for ``x[indices]`` and ``x[indices] = values`` (ATen's ``index`` and
    ``index_put_``): indices on the host are copied to a device ``x``, but a host ``x`` refuses
    device indices; the values written must be on ``x``'s device, or a 0-dim host scalar."""
    self, indices = args[0], [i for i in args[1] if isinstance(i, torch.Tensor)]
    values = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
    if not on_device(self):
        if any(on_device(i) for i in indices):
            raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed "
                               f"tensor (cpu) (when checking arguments for {name}) [strict CUDA emulation]")
        if values is not None and on_device(values):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                               f"devices, cpu and cuda:0! (when checking argument values for {name}) "
                               f"[strict CUDA emulation]")
    elif values is not None and values.dim() > 0 and on_host(values):
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"cuda:0 and cpu! (when checking argument values for {name}: a host tensor of "
                           f"shape {tuple(values.shape)} written into a device tensor) [strict CUDA emulation]")


def handle_function(func, args, kwargs, call):
    """The torch-function half, called by :class:`.cpu_emulation.CudaDeviceToCpuMode` in strict
    mode (``call(args, kwargs)`` runs its rewritten call): what is created for CUDA becomes
    a device tensor, moves copy, host syncs at the Python level are counted."""
    if func is torch.Tensor.cuda:
        t = args[0]
        return t if on_device(t) else mark(t.clone(), True)
    if func is torch.Tensor.cpu:
        t = args[0]
        if not on_device(t):
            return t
        _count_sync()
        return mark(t.clone(), False)
    if func is torch.Tensor.tolist or func is torch.Tensor.numpy:
        if on_device(args[0]):
            if func is torch.Tensor.numpy:
                raise TypeError("can't convert cuda:0 device type tensor to numpy. Use "
                                "Tensor.cpu() to copy the tensor to host memory first. "
                                "[strict CUDA emulation]")
            _count_sync()
        return call(args, kwargs)
    if func is torch.Tensor.to:
        return _to(args, kwargs, call)
    to_cuda = "device" in kwargs and _is_cuda_device(kwargs["device"])
    out = call(args, kwargs)
    for o in (out,) if isinstance(out, torch.Tensor) else _leaves(out, []):  # made by Python code: where it asked, else the host
        if isinstance(o, torch.Tensor) and (to_cuda or _tag(o) is None):
            mark(o, to_cuda)
    return out


def _to(args, kwargs, call):
    t = args[0]
    target = kwargs.get("device")
    if target is None and len(args) > 1 and isinstance(args[1], (torch.device, str, int)) \
            and not isinstance(args[1], bool):
        target = args[1]
    if target is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
        target = _CUDA0 if on_device(args[1]) else torch.device("cpu")
    if target is None:
        return call(args, kwargs)  # dtype only: stays where it is
    want_device = _is_cuda_device(target)
    if want_device == on_device(t):
        return call(args, kwargs)
    if not want_device and not kwargs.get("non_blocking", False):
        _count_sync()  # non_blocking: the wait comes at a synchronize
    moved = call(args, kwargs)
    if moved is t or _storage(moved) is _storage(t):
        moved = moved.clone()  # a move is a copy, as on a GPU
    return mark(moved, want_device)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _base_get(base, t):
    if type(t) in _PLAIN_TENSORS:
        return base.__get__(t)
    with torch._C.DisableTorchFunctionSubclass():  # wrapper subclasses (ShardedTensor, ...)
        return base.__get__(t)


def _tracked_property(base, on_device_value):
    """``Tensor.<attr>`` answering ``on_device_value`` for device tensors, else the real one."""
    def get(self):
        if type(self) in _PLAIN_TENSORS and on_device(self):
            return on_device_value
        return _base_get(base, self)
    return property(get)


def _new_group_recording_gloo(new_group):
    @functools.wraps(new_group)
    def recording(*args, **kwargs):
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER \
                and backend is not None and str(backend).lower() == "gloo":
            _gloo_groups.add(group.group_name)
        return group
    return recording


def _object_collective_device(group=None) -> str:
    """torch serialises object collectives into tensors on the device their backend needs."""
    if group is not None and group.group_name in _gloo_groups:
        return "cpu"
    return "cuda"


_MODE: DeviceResidencyMode | None = None
_SAVED: dict = {}


def install() -> None:
    """Patch what strict mode needs (once) and enter the residency mode for this process.
    Call after the plain emulation (which maps CUDA devices to the CPU) is installed."""
    global _MODE
    if _MODE is not None:
        return
    base = torch._C.TensorBase
    c10d = dist.distributed_c10d
    _SAVED.update(device=torch.Tensor.__dict__.get("device"), is_cuda=torch.Tensor.__dict__.get("is_cuda"),
                  get_device=torch.Tensor.__dict__.get("get_device"),
                  current_device=torch.cuda.current_device, new_group=dist.new_group,
                  coll_device=c10d._get_object_coll_device,
                  capability=torch.cuda.get_device_capability)
    torch.Tensor.device = _tracked_property(base.__dict__["device"], _CUDA0)
    torch.Tensor.is_cuda = _tracked_property(base.__dict__["is_cuda"], True)
    torch.Tensor.get_device = lambda self: 0 if on_device(self) else base.get_device(self)
    torch.cuda.current_device = lambda: _CUDA0  # an int on GPUs; both work as device=
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # code paths of an H100/H200
    dist.new_group = _new_group_recording_gloo(dist.new_group)
    c10d._get_object_coll_device = _object_collective_device
    _MODE = DeviceResidencyMode()
    _MODE.__enter__()


def uninstall() -> None:
    """Undo :func:`install` (one-process tests switch strict mode on and off)."""
    global _MODE
    if _MODE is None:
        return
    _MODE.__exit__(None, None, None)
    _MODE = None
    for name in ("device", "is_cuda", "get_device"):
        if _SAVED[name] is None:
            delattr(torch.Tensor, name)
        else:
            setattr(torch.Tensor, name, _SAVED[name])
    torch.cuda.current_device = _SAVED["current_device"]
    torch.cuda.get_device_capability = _SAVED["capability"]
    dist.new_group = _SAVED["new_group"]
    dist.distributed_c10d._get_object_coll_device = _SAVED["coll_device"]


def is_active() -> bool:
    return _MODE is not None
