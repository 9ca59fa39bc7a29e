"""GPU telemetry: the values path against a fake NVML, the no-NVML path against the real one."""

import types

import pytest

from megatron_rl.telemetry import GpuTelemetry, visible_device_ids

GIB = 1 << 30


class FakeNvml(types.SimpleNamespace):
    """The slice of pynvml that telemetry uses, over a dict of fake GPUs keyed by index/UUID."""

    class NVMLError(Exception):
        pass

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, gpus, fail_init=False):
        super().__init__(gpus=gpus, fail_init=fail_init, init_calls=0, shutdown_calls=0)

    def nvmlInit(self):
        self.init_calls += 1
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self):
        return sum(1 for key in self.gpus if isinstance(key, int))

    def nvmlDeviceGetHandleByIndex(self, index):
        if index not in self.gpus:
            raise self.NVMLError("Invalid Argument")
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.gpus:
            raise self.NVMLError("Not Found")
        return self.gpus[uuid]

    def _get(self, gpu, name):
        value = gpu[name]
        if value is None:
            raise self.NVMLError("Not Supported")
        return value

    def nvmlDeviceGetMemoryInfo(self, gpu):
        used, total = self._get(gpu, "mem")
        return types.SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, gpu):
        return types.SimpleNamespace(gpu=self._get(gpu, "util"), memory=0)

    def nvmlDeviceGetPowerUsage(self, gpu):
        return self._get(gpu, "power_mw")

    def nvmlDeviceGetTemperature(self, gpu, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._get(gpu, "temp")


def _gpu(used_gib, util, power_mw, temp):
    return {"mem": (used_gib * GIB, 80 * GIB), "util": util, "power_mw": power_mw, "temp": temp}


@pytest.fixture
def two_gpus():
    return FakeNvml({0: _gpu(3, 57, 312_500, 61), 1: _gpu(40, 100, 700_000, 75)})


def test_every_local_gpu_is_sampled(two_gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    lines = []
    tel = GpuTelemetry(nvml=two_gpus, log=lines.append)
    assert tel.available and lines == []
    first, second = tel.sample(), tel.sample()
    assert first == second == {
        "gpu0/mem_used_gib": 3.0, "gpu0/mem_total_gib": 80.0, "gpu0/util_pct": 57.0,
        "gpu0/power_w": 312.5, "gpu0/temp_c": 61.0,
        "gpu1/mem_used_gib": 40.0, "gpu1/mem_total_gib": 80.0, "gpu1/util_pct": 100.0,
        "gpu1/power_w": 700.0, "gpu1/temp_c": 75.0,
    }
    assert all(isinstance(v, float) for v in first.values())
    assert two_gpus.init_calls == 1
    tel.close()
    tel.close()
    assert two_gpus.shutdown_calls == 1 and tel.sample() == {}


def test_cuda_visible_devices_pick_and_order_the_gpus(monkeypatch):
    nvml = FakeNvml({0: _gpu(1, 0, 1000, 30), 2: _gpu(2, 0, 1000, 30), "GPU-abc": _gpu(5, 0, 1000, 30)})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc,2")
    values = GpuTelemetry(nvml=nvml).sample()
    assert values["gpu0/mem_used_gib"] == 5.0 and values["gpu1/mem_used_gib"] == 2.0
    assert not any(k.startswith("gpu2/") for k in values)


def test_a_value_the_board_does_not_report_is_left_out(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml({0: _gpu(1, 10, None, 40)})
    values = GpuTelemetry(nvml=nvml).sample()
    assert "gpu0/power_w" not in values and values["gpu0/temp_c"] == 40.0 and values["gpu0/util_pct"] == 10.0


@pytest.mark.parametrize(
    "nvml, devices, reason",
    [
        (FakeNvml({0: _gpu(1, 0, 0, 0)}, fail_init=True), None, "NVML unavailable: Driver Not Loaded"),
        (FakeNvml({0: _gpu(1, 0, 0, 0)}), [3], "NVML could not open the GPUs: Invalid Argument"),
        (FakeNvml({}), None, "NVML found no GPU"),
    ],
)
def test_nvml_failures_turn_telemetry_off_with_one_line(nvml, devices, reason, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    lines = []
    tel = GpuTelemetry(devices, nvml=nvml, log=lines.append)
    assert not tel.available and tel.sample() == {} and tel.sample() == {}
    assert lines == [f"telemetry: GPU telemetry is off ({reason})"]
    assert nvml.shutdown_calls == (0 if nvml.fail_init else 1)


def test_real_nvml_without_a_driver_logs_once_and_never_raises(capsys):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver; tests/gpu/test_fp8_gpu.py covers real readings")
    with GpuTelemetry() as tel:
        for _ in range(3):
            assert tel.sample() == {}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("telemetry: GPU telemetry is off (NVML unavailable:")


@pytest.mark.parametrize(
    "value, expected",
    [(None, None), ("0,1", ["0", "1"]), ("", []), ("3,GPU-9f2a,MIG-1", ["3", "GPU-9f2a", "MIG-1"]),
     ("1,bogus,2", ["1"]), (" 2 , 0", ["2", "0"])],
)
def test_visible_device_ids(value, expected):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_device_ids(env) == expected
