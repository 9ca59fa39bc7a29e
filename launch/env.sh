# Environment for megatron-rl jobs: NCCL, error handling and threading.
# Sourced by launch/slurm/*.sbatch; source it yourself before a hand-started torchrun:
#   . launch/env.sh && python -m megatron_rl.launcher --config configs/<preset>.yaml
# Every variable keeps a value that is already set, so a site or a user can override it.

# A failed or timed-out collective aborts the process instead of hanging the job, so the
# launcher sees a non-zero exit and Slurm ends the allocation (replaces the deprecated
# NCCL_ASYNC_ERROR_HANDLING).
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# Warnings and errors only; set NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) to see
# which transport (NVLink, InfiniBand, sockets) NCCL picked.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Megatron-Core overlaps tensor/sequence-parallel communication with compute by the order
# in which kernels are queued; one hardware queue per device keeps that order.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# Do not let the caching allocator hold NCCL buffers alive through record_stream.
export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
# Worker output reaches the per-node logs line by line.
export PYTHONUNBUFFERED=1
# Threads: the launcher sets OMP_NUM_THREADS per worker to (CPUs on the node) / (workers
# per node) unless it is set here or by the site. The network interfaces for NCCL and gloo
# (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA) are cluster-specific: set them in
# the site environment when the defaults pick the wrong NIC.
