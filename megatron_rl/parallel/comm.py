"""Collectives and point-to-point transfers of tensors and objects, whatever the group's backend.

Counts, metrics, routing records and broadcast results live on the host, but NCCL groups
only move CUDA tensors. These helpers move a tensor to the group's device for the
collective and hand the result back on the tensor's own device, so the same code runs
on gloo (CPU, tests) and NCCL (GPU clusters). The process group is always passed in
(``ParallelGroups.world`` for every rank), to the rank queries too; outside
``megatron_rl.parallel`` no module calls ``torch.distributed`` collectives itself (a test
holds the rule). :func:`raise_first_failure` is the one way ranks agree that a step failed
somewhere. Does not own creating process groups (``groups``, ``world``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device a collective on ``group`` needs its tensors on."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank(group: dist.ProcessGroup) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


def size(group: dist.ProcessGroup) -> int:
    """The number of ranks in ``group``."""
    return dist.get_world_size(group)


def global_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return dist.get_process_group_ranks(group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``; returns it."""
    device = group_device(group)
    work = tensor.to(device)
    dist.all_reduce(work, op=op, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank inside ``group`` and the group's size; ``None`` is a group of one."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _SumIdentityBackward(torch.autograd.Function):
    """Forward: all-reduce SUM. Backward: the identity (see :func:`sum_identity_backward`)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce(values.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_identity_backward(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``values`` summed over ``group`` (each rank holding its share, the others 0), with the
    identity as backward: every rank computes the same objective from the sum, so each rank's
    gradient at its own share is already the whole gradient there (Megatron's "reduce from the
    model-parallel region"). ``None`` is a group of one."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    return _SumIdentityBackward.apply(values, group)


def all_gather_cat(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape on all ranks), concatenated along ``dim``."""
    device = group_device(group)
    # Collectives move bytes; bool has no reduction type in gloo, so travel as uint8.
    is_bool = tensor.dtype == torch.bool
    work = (tensor.to(torch.uint8) if is_bool else tensor).to(device).contiguous()
    parts = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, work, group=group)
    out = torch.cat(parts, dim=dim).to(tensor.device)
    return out.bool() if is_bool else out


def all_gather_varlen(
    tensor: torch.Tensor, group: dist.ProcessGroup, sizes: list[int] | None = None
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, where dim 0 may differ between ranks.

    Trailing dimensions and dtype must match on all ranks. ``sizes`` (every rank's dim-0
    length, in group-rank order) saves the collective that learns them when the caller
    already knows them. Rows come in group-rank order, each rank's in its own order.
    """
    if sizes is None:
        sizes = all_gather_cat(torch.tensor([tensor.shape[0]], dtype=torch.int64), group).tolist()
    longest = max(sizes)
    if longest == 0:
        return tensor.new_zeros((0, *tensor.shape[1:]))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = all_gather_cat(padded, group).split(longest)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place broadcast from the group-local rank ``src_group_rank``; returns ``tensor``."""
    device = group_device(group)
    work = tensor.to(device)
    dist.broadcast(work, src=dist.get_global_rank(group, src_group_rank), group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def send(tensor: torch.Tensor, dst_group_rank: int, group: dist.ProcessGroup) -> None:
    """Blocking send of ``tensor`` to the group-local rank ``dst_group_rank``, which calls
    :func:`recv` with a tensor of the same shape and dtype."""
    work = tensor.to(group_device(group)).contiguous()
    dist.send(work, dst=dist.get_global_rank(group, dst_group_rank), group=group)


def recv(tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Blocking receive into ``tensor`` of what the group-local rank ``src_group_rank``
    sends with :func:`send`; returns ``tensor``."""
    work = tensor.to(group_device(group))
    dist.recv(work, src=dist.get_global_rank(group, src_group_rank), group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast_object(obj, src_group_rank: int, group: dist.ProcessGroup):
    """A picklable object from the group-local rank ``src_group_rank`` to every rank."""
    box = [obj]
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(group, src_group_rank), group=group, device=group_device(group)
    )
    return box[0]


def exchange_objects(outgoing: list[list], group: dist.ProcessGroup) -> list[list]:
    """All-to-all of picklable objects: ``outgoing[r]`` goes to group rank ``r``.

    Returns what every group rank sent to this one, in group-rank order. Each object
    travels once, to its destination only (unlike an all-gather of objects, which copies
    every rank's objects to every rank).
    """
    import pickle

    size = dist.get_world_size(group)
    if len(outgoing) != size:
        raise ValueError(f"exchange_objects: {len(outgoing)} destinations for a group of {size}")
    device = group_device(group)
    payloads = [pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL) for items in outgoing]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    recv_sizes = torch.empty(size, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_sizes, send_sizes.to(device), group=group)
    recv_sizes = recv_sizes.cpu()
    send = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send.to(device), output_split_sizes=recv_sizes.tolist(),
                           input_split_sizes=send_sizes.tolist(), group=group)
    chunks = recv.cpu().split(recv_sizes.tolist())
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in chunks]


def barrier(group: dist.ProcessGroup) -> None:
    """Wait until every rank of ``group`` arrives."""
    dist.barrier(group=group)


def all_gather_objects(obj, group: dist.ProcessGroup) -> list:
    """Every rank's picklable ``obj``, in group-rank order."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


class RankFailed(RuntimeError):
    """Another rank of the group failed at the same step (raised where this one did not)."""

    def __init__(self, rank: int, message: str, what: str) -> None:
        super().__init__(f"rank {rank} failed {what}: {message}")
        self.rank = rank
        """The first failed rank (its rank in the group)."""


def raise_first_failure(error: BaseException | None, group: dist.ProcessGroup, what: str) -> None:
    """Collective: every rank of ``group`` reports ``error`` (None: it succeeded); when any
    failed, every rank raises: a failed rank its own error, the others :class:`RankFailed`
    naming the first failed rank and its message, so that the run ends on all ranks at the
    same point and the entry point reports the cause once. ``what`` says where, e.g.
    ``"probing the rollout servers"``."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    reports = all_gather_objects(mine, group)
    failed = [(rank, message) for rank, message in enumerate(reports) if message is not None]
    if not failed:
        return
    if error is not None:
        raise error
    rank, message = failed[0]
    raise RankFailed(rank, message, what)


def all_ranks_agree(flag: bool, group: dist.ProcessGroup) -> bool:
    """Collective: True when ``flag`` is True on every rank of ``group``."""
    agreed = torch.tensor([1 if flag else 0])
    if dist.get_world_size(group) > 1:
        all_reduce(agreed, group, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def max_over(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place element-wise maximum of ``tensor`` over ``group``; returns it."""
    if dist.get_world_size(group) > 1:
        all_reduce(tensor, group, op=dist.ReduceOp.MAX)
    return tensor


def mean_over(values: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Collective: each named scalar's mean over the ranks of ``group`` (one all-reduce, in
    float64, names in sorted order on every rank), as float32."""
    names = sorted(values)
    stacked = torch.stack([values[n].double().reshape(()) for n in names])
    size = dist.get_world_size(group)
    if size > 1:
        all_reduce(stacked, group)
        stacked /= size
    return {n: stacked[i].float() for i, n in enumerate(names)}
