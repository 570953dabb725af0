"""Where a cached decode step's time goes: BEM vs the same model with BEM disabled, at batch 1 and 16.
Per-step wall time (synchronised), GPU busy time, and the top ops by host and device time."""

import time

import torch
from bem.call_inputs import CACHE_KEYWORD, returned_cache
from torch.profiler import ProfilerActivity, profile

from breakdown_model import llama_1b_with_bem

model = llama_1b_with_bem()


def decode_steps(batch: int, steps: int, bem_on: bool):
    ids = torch.randint(3, 32000, (batch, 128), device="cuda")
    ctx = model.disable_bem() if not bem_on else torch.autocast("cuda", enabled=False)
    with torch.no_grad(), ctx:
        out = model(input_ids=ids, use_cache=True)
        cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, **{CACHE_KEYWORD: cache}, use_cache=True)
            cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


for batch in (1, 16):
    for bem_on in (False, True, False, True):
        decode_steps(batch, 3, bem_on)  # warm-up, both variants
    times = {name: [decode_steps(batch, 16, on) for _ in range(3)] for name, on in (("base", False), ("bem", True))}
    base_ms, bem_ms = (sorted(times[n])[1] for n in ("base", "bem"))
    print(f"batch {batch}: base {base_ms:.2f} ms/step, bem {bem_ms:.2f} ms/step, overhead {bem_ms / base_ms - 1:+.1%}")
    for name, on in (("base", False), ("bem", True)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode_steps(batch, 4, on)
        events = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in events) / 4 / 1e3
        print(f"  {name}: GPU busy {cuda_total:.2f} ms/step")
        if on:
            print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
            print(events.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=40))
