"""Step ``cuda``: the GPU answers, and the two ceilings the other steps compare with.

Checks that CUDA and NVML see the device and that a bf16 product is right (against float64 on
random data: relative error under 1e-2, bf16 operands land between 1e-3 and 1e-2), then
measures the bf16 GEMM rate (8192^3 on random data, the mean of 10 products after 3 warm-ups)
and the device-to-device copy bandwidth (2 GiB, median of 5; bytes copied, and bytes read +
written). Pass: a CUDA device, NVML answers, the product is right.
"""

from __future__ import annotations

import platform
from importlib.metadata import version

import torch

from gpu_check_steps.common import Context, Outcome, copy_gbps, median_seconds, nvml_used_bytes, verdict

PACKAGES = ("megatron-core", "transformers")
"""Versions recorded with the results (the wheels'; the image's transformers is shadowed)."""
GEMM_N = 8192
COPY_BYTES = 2 << 30


def gemm_tflops(ctx: Context, n: int, repeats: int = 10) -> float:
    """bf16 ``n x n @ n x n`` on random data: 2 n^3 FLOP over the mean time of ``repeats``."""
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16, generator=gen)
    for _ in range(2):
        a @ b

    def products() -> None:
        for _ in range(repeats):
            a @ b

    return 2 * n**3 * repeats / median_seconds(ctx, products, 1) / 1e12


def product_error(ctx: Context, n: int = 512) -> float:
    """‖bf16 product − float64 reference‖ / ‖reference‖ on fresh random inputs."""
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    reference = a.double() @ b.double()
    return float((a @ b).double().sub(reference).norm() / reference.norm())


def run(ctx: Context) -> Outcome:
    if not ctx.dry and not torch.cuda.is_available():
        return Outcome("fail", "torch.cuda.is_available() is False", {"torch": torch.__version__})
    import pynvml

    figures: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                     **{name: version(name) for name in PACKAGES}}
    nvml_used_bytes(ctx)  # NVML initialised (or its calls resolved in the dry run)
    driver = pynvml.nvmlSystemGetDriverVersion
    if not ctx.dry:
        props = torch.cuda.get_device_properties(0)
        figures.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                       memory_gib=round(props.total_memory / (1 << 30), 1), driver=driver())
    error = product_error(ctx, 512 if not ctx.dry else 32)
    tflops = gemm_tflops(ctx, GEMM_N if not ctx.dry else 64)
    block = torch.empty((COPY_BYTES if not ctx.dry else 1 << 20,), dtype=torch.uint8, device=ctx.device)
    copied = copy_gbps(ctx, [block.random_()])
    figures.update(bf16_product_rel_error=error, gemm_bf16_tflops=round(tflops, 1),
                   copy_gbs=round(copied, 1), copy_gbs_read_plus_write=round(2 * copied, 1))
    ok = error < 1e-2
    headline = (f"{figures.get('device', 'cpu')} (cc {figures.get('capability', '-')}, driver "
                f"{figures.get('driver', '-')}): bf16 GEMM {tflops:.0f} TFLOP/s, copy {copied:.0f} GB/s "
                f"({2 * copied:.0f} read+write), product error {error:.1e}")
    return Outcome(verdict(ctx, ok), headline, figures)
