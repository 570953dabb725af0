"""Where a kernel's warps stall, from Nsight Compute's source page (scripts/fftconv_ncu.sh writes one per
kernel: `ncu -i REPORT --page source --csv --print-source sass | gzip`):

    python3 scripts/ncu_source_summary.py ncu_backward_8x768x8192.csv.gz [--region 500]

Prints the stall reasons over the whole kernel, then per region of --region consecutive SASS instructions:
its stall samples, its top three reasons and its most frequent opcodes (which tell the phase: LDG/SHF the
bf16 loads, FADD/FFMA the butterflies, FSEL the GELU, LDS/STS the passes through shared memory).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv_gz")
    parser.add_argument("--region", type=int, default=500)
    args = parser.parse_args()
    rows = list(csv.reader(gzip.open(args.csv_gz, "rt")))
    header, data = rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = col["Warp Stall Sampling (All Samples)"]
    executed = col["Instructions Executed"]
    number = lambda row, c: int(row[c] or 0)  # noqa: E731

    total = sum(number(r, samples) for r in data)
    by_reason = collections.Counter({s: sum(number(r, col[s]) for r in data) for s in reasons})
    print(f"{args.csv_gz}: {len(data)} SASS instructions, {total} stall samples")
    for reason, n in by_reason.most_common(8):
        print(f"  {reason[6:]:18s} {n:8d} {n / max(total, 1):6.1%}")
    print(f"\n{'from':>6s} {'samples':>8s} {'executed':>11s}  top reasons | top opcodes")
    for start in range(0, len(data), args.region):
        block = data[start:start + args.region]
        top = collections.Counter({s[6:]: sum(number(r, col[s]) for r in block) for s in reasons})
        ops = collections.Counter()
        for r in block:
            words = r[col["Source"]].split()
            if words:
                op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
                ops[op.split(".")[0]] += 1
        print(f"{start:6d} {sum(number(r, samples) for r in block):8d} {sum(number(r, executed) for r in block):11d}  "
              + " ".join(f"{k}={v}" for k, v in top.most_common(3)) + " | "
              + " ".join(f"{k}:{v}" for k, v in ops.most_common(5)))


if __name__ == "__main__":
    main()
