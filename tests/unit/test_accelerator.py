"""The accelerator answers DeepSpeed's accelerator calls with DeepSpeed's values."""

import contextlib
import inspect
import os

import pytest
import torch

from shardwise.accelerator import Accelerator, get_accelerator

CPU = Accelerator("cpu", "gloo")
CUDA = Accelerator("cuda", "nccl")


def test_get_accelerator_on_a_cpu_machine(monkeypatch):
    monkeypatch.setenv("SHARDWISE_ACCELERATOR", "cpu")
    assert get_accelerator() == CPU


def test_cpu_device_queries(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert CPU.device() == torch.device("cpu")
    assert (CPU.device_name(), CPU.device_name(3), CPU.current_device_name()) == ("cpu", "cpu", "cpu")
    assert (CPU.current_device(), CPU.device_count()) == (0, 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert (CPU.current_device(), CPU.device_count()) == (2, 4)
    assert CPU.set_device(5) is None
    assert CPU.synchronize() is None and CPU.synchronize(0) is None
    assert CPU.is_available() is True
    assert CPU.communication_backend_name() == "gloo"


def test_cuda_names_need_no_gpu():
    assert (CUDA.device_name(), CUDA.device_name(1)) == ("cuda", "cuda:1")
    assert CUDA.device(3) == torch.device("cuda", 3)
    assert CUDA.communication_backend_name() == "nccl"
    assert CUDA.supports_fused_optimizers() is True and CPU.supports_fused_optimizers() is False


def test_synchronous_device_flags():
    cpu_flags = [
        CPU.is_synchronized_device(),
        CPU.use_host_timers(),
        CPU.resolves_data_dependency(),
        CPU.handles_memory_backpressure(),
    ]
    cuda_flags = [
        CUDA.is_synchronized_device(),
        CUDA.use_host_timers(),
        CUDA.resolves_data_dependency(),
        CUDA.handles_memory_backpressure(),
    ]
    assert cpu_flags == [True] * 4
    assert cuda_flags == [False] * 4


def test_cpu_dtypes():
    assert CPU.is_bf16_supported() is True
    fp16 = CPU.is_fp16_supported()
    assert fp16 is bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert CPU.supported_dtypes() == [torch.float32, torch.bfloat16] + ([torch.float16] if fp16 else [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer before a GPU is visible")
def test_cuda_dtypes_without_a_visible_gpu():
    # DeepSpeed answers True for both until a GPU is visible (e.g. while building ops)
    assert (CUDA.is_bf16_supported(), CUDA.is_fp16_supported()) == (True, True)
    assert CUDA.supported_dtypes() == [torch.float32, torch.float16, torch.bfloat16]
    assert CUDA.is_triton_supported() is False


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux procfs")
def test_cpu_memory_is_process_rss_and_tracks_a_peak():
    before = CPU.memory_allocated()
    assert abs(before - _rss_bytes()) < 64 << 20
    CPU.reset_max_memory_allocated()
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched so it is resident
    peak_with_block = CPU.max_memory_allocated()
    assert peak_with_block >= before + (48 << 20)
    del block
    # the peak survives the free and is shared by every get_accelerator() object
    assert Accelerator("cpu", "gloo").max_memory_reserved() >= peak_with_block
    CPU.reset_max_memory_allocated()
    assert CPU.max_memory_allocated() < peak_with_block
    assert CPU.memory_reserved() > 0 and CPU.memory_cached() > 0
    stats = CPU.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert CPU.total_memory() == total
    assert 0 < CPU.available_memory() <= total
    assert CPU.empty_cache() is None


def test_cpu_rng_follows_torch_default_generator():
    CPU.manual_seed(1234)
    assert CPU.initial_seed() == 1234
    state = CPU.get_rng_state()
    first = torch.rand(3)
    CPU.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    CPU.manual_seed_all(7)
    assert torch.initial_seed() == 7
    assert isinstance(CPU.seed(), int)
    assert CPU.random() is torch.random
    assert CPU.default_generator(0) is torch.default_generator


def test_cpu_tensor_placement_and_pinning():
    t = torch.ones(4)
    assert CPU.pin_memory(t) is t and CPU.pin_memory(t, 64) is t
    assert CPU.is_pinned(t) is False
    assert CPU.on_accelerator(t) is True
    assert CUDA.on_accelerator(t) is False
    assert CPU.on_accelerator(torch.empty(1, device="meta")) is False


def test_cpu_streams_ranges_and_lazy_call():
    assert (CPU.Stream, CPU.Event, CPU.current_stream(), CPU.default_stream()) == (None, None, None, None)
    assert isinstance(CPU.stream(None), contextlib.nullcontext)
    with CPU.side_stream():
        pass
    assert CPU.range_push("step") is None and CPU.range_pop() is None
    calls = []
    assert CPU.lazy_call(lambda: calls.append(1) or "ran") == "ran"
    assert calls == [1]


def test_signatures_follow_deepspeed():
    def names(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    none_index = [("device_index", None)]
    for method in (
        CPU.device_name,
        CPU.synchronize,
        CPU.memory_allocated,
        CPU.max_memory_allocated,
        CPU.reset_max_memory_allocated,
        CPU.memory_reserved,
        CPU.max_memory_reserved,
        CPU.total_memory,
        CPU.available_memory,
        CPU.current_stream,
        CPU.default_stream,
    ):
        assert names(method) == none_index, method.__name__
    assert names(CPU.pin_memory)[:2] == [("tensor", inspect.Parameter.empty), ("align_bytes", 1)]
    assert names(CPU.range_push) == [("msg", inspect.Parameter.empty), ("domain", None), ("category", None)]
