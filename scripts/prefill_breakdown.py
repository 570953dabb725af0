"""Where a prefill forward's time goes: BEM vs the same model with BEM disabled (Llama-3.2-1B shapes, or
GPT-2 small's with --model gpt2; bf16, eager attention), at batch 1 and 4 over 1024 tokens. Per call:
synchronised wall time, the host's time to issue the work (no sync), GPU busy time, the controller
alone, and the top ops by device time."""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from breakdown_model import MODELS

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", choices=sorted(MODELS), default="llama-1b")
model = MODELS[parser.parse_args().model]()
controller = model.controller
vocab, width = model.config.vocab_size, model.config.hidden_size


def prefill(ids, bem_on: bool):
    ctx = model.disable_bem() if not bem_on else torch.autocast("cuda", enabled=False)
    with torch.inference_mode(), ctx:
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)


def timed(fn, sync_first=True):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) * 1e3, (time.perf_counter() - start) * 1e3


a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.perf_counter() + 1.0
while time.perf_counter() < end:
    a @ a
for batch in (1, 4):
    ids = torch.randint(3, vocab, (batch, 1024), device="cuda")
    hidden = model.get_input_embeddings()(ids)
    for _ in range(3):
        prefill(ids, False), prefill(ids, True)
    rows = {"base": [], "bem": [], "controller": []}
    for _ in range(9):
        rows["base"].append(timed(lambda: prefill(ids, False)))
        rows["bem"].append(timed(lambda: prefill(ids, True)))
        with torch.inference_mode():
            rows["controller"].append(timed(lambda: controller(hidden, torch.ones_like(ids), None,
                                                               out_dtype=torch.bfloat16, return_state=True)))
    print(f"prefill b{batch} s1024 (median of 9; host = time to issue, wall = synchronised)")
    for name, values in rows.items():
        host = statistics.median(v[0] for v in values)
        wall = statistics.median(v[1] for v in values)
        print(f"  {name:10s} host {host:7.3f} ms   wall {wall:7.3f} ms")
    for name, on in (("base", False), ("bem", True)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                prefill(ids, on)
            torch.cuda.synchronize()
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 3 / 1e3
        print(f"  {name}: GPU busy {busy:.3f} ms per call")
        if on:
            print(events.table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=60))

ids = torch.randint(3, vocab, (1, 1024), device="cuda")
hidden = model.get_input_embeddings()(ids)
with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        controller(hidden, torch.ones_like(ids), None, out_dtype=torch.bfloat16, return_state=True)
print("controller alone, b1 s1024, host time by op (5 calls)")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))

# memory kept by one captured whole-sequence call, at the largest size captured
graphs = controller.graphs
from bem.modules.controller_graphs import FORWARD_MAX_CODE_VALUES  # noqa: E402

tokens = FORWARD_MAX_CODE_VALUES // (controller.num_modules * controller.rank)
hidden = torch.randn(1, tokens, width, device="cuda", dtype=torch.bfloat16)
with torch.inference_mode():
    controller(hidden)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # as the capture itself does first
    before = torch.cuda.memory_reserved()
    controller(hidden)
    torch.cuda.synchronize()
    print(f"one captured call of {tokens} tokens ({controller.num_modules} modules, rank {controller.rank}): "
          f"{(torch.cuda.memory_reserved() - before) / 2**20:.1f} MiB reserved; graphs kept {len(graphs._forwards)}")
