# SPDX-License-Identifier: Apache-2.0
"""Writes bench/RESULTS.md, and the README's table of headline figures, from one run's JSON.

    /usr/bin/python3 bench/results.py --results bench/results --build build/release \\
        --out bench/RESULTS.md --readme README.md

Reads the Google Benchmark JSON that bench/run.sh leaves in --results (and the tables.md that
bench/plot.py writes there), the machine from /proc/cpuinfo and the compiler from the build
tree's CMakeCache.txt. Every figure is a counter of one benchmark entry of this run: a ratio
whose two sides the benchmark timed in turn. A figure whose benchmark did not run is left out.
A smoke run (KVCACHE_BENCH_SMOKE) is marked as such and never touches the README. Standard
library only, so that it runs where matplotlib is missing.
"""

import argparse
import json
import os
import pathlib
import platform
import re
import subprocess
import sys

BENCHES = ("cache_bench", "model_bench", "attention_bench", "read_path_bench", "threads_bench")
README_BEGIN = "<!-- figures:begin -->"
README_END = "<!-- figures:end -->"


def load(directory):
    data = {}
    for name in BENCHES:
        path = directory / f"{name}.json"
        if path.exists():
            with path.open() as f:
                data[name] = json.load(f)
    return data


def entries(data, bench, prefix):
    """Iteration entries of `bench` whose name starts with `prefix`."""
    if bench not in data:
        return []
    return [b for b in data[bench]["benchmarks"]
            if b["name"].startswith(prefix) and b.get("run_type", "iteration") == "iteration" and "error_occurred" not in b]


def arg(entry, name):
    match = re.search(rf"(?:^|/){re.escape(name)}:(\d+)(?:/|$)", entry["name"])
    return int(match.group(1)) if match else None


def element(entry):
    for name in ("bfloat16", "bf16", "half", "float"):
        if f"<{name}>" in entry["name"] or f"/{name}/" in entry["name"]:
            return "bf16" if name == "bfloat16" else name
    return "float"


def times(x):
    return f"{x:,.0f}×" if x >= 100 else f"{x:.3g}×"


def ratio(x):
    return f"{x:.2f}" if x < 10 else f"{x:.3g}"


def spread(values):
    lo, hi = min(values), max(values)
    return ratio(lo) if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def by_type(rows, text):
    """'a (float), b (bf16)' in float, bf16, half order."""
    order = {"float": 0, "bf16": 1, "half": 2}
    return ", ".join(f"{text(r)} ({t})" for t, r in sorted(rows.items(), key=lambda kv: order.get(kv[0], 3)))


def headline(data):
    """[(what, measured)] for the figures this run has."""
    rows = []

    # Whole generation through each cache: the largest prompt and loop that ran both full loops.
    full = [b for b in entries(data, "cache_bench", "generate/") if b.get("concat_full_loop") == 1]
    if full:
        p, n = max((int(b["P"]), int(b["N"])) for b in full)
        cells = {element(b): b for b in full if int(b["P"]) == p and int(b["N"]) == n}
        model = data["cache_bench"]["context"].get("kvcache_model", "")
        rows.append((f"`ConcatKvCache` ÷ `KvCache` time, {n} tokens after a prompt of {p}, every layer ({model})",
                     by_type(cells, lambda b: times(b["concat_over_cache"]))))

    chunks = {element(b): b for b in entries(data, "cache_bench", "prefill_chunk/")}
    if chunks:
        b = next(iter(chunks.values()))
        rows.append((f"`update()` speed ÷ `memcpy` speed, a {int(b['T'])}-token chunk into {int(b['layers'])} layers",
                     by_type(chunks, lambda e: ratio(e["update_over_memcpy"]))))

    for b in entries(data, "cache_bench", "token_flat/")[:1]:
        rows.append((f"single-token `update()` time at history {int(b['far_history']):,} ÷ at {int(b['near_history']):,}",
                     ratio(b["far_over_near"])))

    for b in entries(data, "cache_bench", "ring_decode/")[:1]:
        at = sorted(int(k[len("us_per_token_at_"):]) for k in b if k.startswith("us_per_token_at_"))
        sizes = {b[f"bytes_at_{p}"] for p in at}
        held = f"; `bytes()` {size(sizes.pop())} at every position" if len(sizes) == 1 else ""
        rows.append((f"`RingKvCache` (window {int(b['window']):,}) time per token at position {at[-1]:,} ÷ at {at[0]:,}",
                     ratio(b["last_over_first"]) + held))

    model = sorted((b for b in entries(data, "model_bench", "model_generate/") if b.get("uncached_full_loop") == 1),
                   key=lambda b: b["N"])
    if model:
        rows.append(("reference model tokens/s, `KvCache` ÷ no cache, " +
                     " / ".join(f"N = {int(b['N'])}" for b in model),
                     " / ".join(times(b["cached_over_uncached"]) for b in model)))

    decode = [b for b in entries(data, "attention_bench", "DecodeAttention<")
              if "/q:" not in b["name"] and isinstance(b.get("vs_read"), (int, float))]
    if decode:
        s = max(arg(b, "S") or 0 for b in decode)
        one = [b for b in decode if arg(b, "S") == s and (arg(b, "threads") or 1) == 1]
        cells = {}
        for b in one:
            cells.setdefault(element(b), []).append(b["vs_read"])
        heads = sorted({arg(b, "H_q") for b in one if arg(b, "H_q")})
        what = f"decode attention speed ÷ a plain read of the same K and V bytes, {s:,} keys, one thread"
        rows.append((what + (f", H_q {heads[0]}–{heads[-1]}" if heads else ""), by_type(cells, spread)))

    paged = [b for b in entries(data, "read_path_bench", "PagedDecode<") if isinstance(b.get("vs_contiguous"), (int, float))]
    if paged:
        s = max(arg(b, "S") or 0 for b in paged)
        cells = [b for b in paged if arg(b, "S") == s]
        rows.append((f"decode over {int(cells[0]['segments']):,} pages ÷ over one segment of the same {s:,} keys, speed",
                     f"{spread([b['vs_contiguous'] for b in cells])} in all {len(cells)} cells (float, bf16, half; "
                     "H_q; one and two threads)"))

    calls = {}
    for b in entries(data, "threads_bench", "DecodeLayers<float>"):
        if isinstance(b.get("us_per_call"), (int, float)):
            calls.setdefault(arg(b, "S"), {})[arg(b, "threads")] = b
    complete = [s for s, by in calls.items() if s is not None and 1 in by and 2 in by]
    if complete:
        s = max(complete)
        one, two = calls[s][1], calls[s][2]
        rows.append((f"decode call over {size(one['bytes_per_call'])} of K and V, one thread ÷ two threads, "
                     "time", ratio(one["us_per_call"] / two["us_per_call"])))
    return rows


def table(rows):
    return "\n".join(["| what | measured |", "| --- | --- |"] + [f"| {what} | {value} |" for what, value in rows])


VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16")


def cpu():
    """(model, vector extensions) of the first processor in /proc/cpuinfo."""
    fields = {}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    model = fields.get("model name", platform.processor() or "unknown")
    if "cpu family" in fields:
        model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    flags = set(fields.get("flags", "").split())
    return model, ", ".join(f for f in VECTOR_FLAGS if f in flags) or "unknown"


def size(bytes_):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if bytes_ >= scale:
            return f"{bytes_ / scale:,.1f} {unit}"
    return f"{bytes_:,.0f} B"


def compiler(build):
    cache = build / "CMakeCache.txt" if build else None
    path, flags = "c++", ""
    if cache and cache.exists():
        text = cache.read_text()
        found = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.*)$", text, re.MULTILINE)
        path = found.group(1) if found else path
        found = re.search(r"^CMAKE_CXX_FLAGS_RELEASE:\w+=(.*)$", text, re.MULTILINE)
        flags = found.group(1) if found else ""
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        version = path
    return version + (f", `{flags} -march=native`" if flags else "")


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("KVCACHE_COMMIT", "unknown")


def smoke(data):
    return any("smoke" in str(d.get("context", {}).get("kvcache_bench_mode", "")) for d in data.values())


def results_page(data, rows, args):
    context = next(iter(data.values()))["context"] if data else {}
    plots = [p for p in ("cache_vs_concat", "ring", "model", "attention_bandwidth") if (args.results / f"{p}.png").exists()]
    tables = args.results / "tables.md"
    lines = ["<!-- SPDX-License-Identifier: Apache-2.0 -->",
             "<!-- Written by bench/run.sh (bench/results.py) from its run; not edited by hand. -->",
             "# Benchmark results", ""]
    if smoke(data):
        lines += ["**Smoke run (`KVCACHE_BENCH_SMOKE`): tiny shapes, a check that the programs and this page work. "
                  "Not figures.**", ""]
    model, vector = cpu()
    lines += ["| machine | |", "| --- | --- |",
              f"| CPU | {model} |",
              f"| vector extensions | {vector} |",
              f"| logical CPUs | {context.get('num_cpus', os.cpu_count())} |",
              f"| compiler | {compiler(args.build)} |",
              f"| commit | `{commit()}` |",
              "", "More of the machine (lscpu, memory, load) in [results/machine.txt](results/machine.txt). Each figure "
              "is a ratio of two sides timed in turn inside one benchmark of this run; absolute times are for scale.",
              "", "## Headline", "", table(rows) if rows else "No benchmark of this run gave a headline figure.", ""]
    for plot in plots:
        lines += [f"![{plot}](results/{plot}.png)", ""]
    if tables.exists():
        lines += ["## Tables", "", tables.read_text().rstrip(), ""]
    return "\n".join(lines)


def update_readme(readme, rows):
    text = readme.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        sys.exit(f"results.py: {readme} has no {README_BEGIN} ... {README_END} block")
    readme.write_text(text[:begin + len(README_BEGIN)] + "\n" + table(rows) + "\n" + text[end:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("bench/results"))
    parser.add_argument("--build", type=pathlib.Path, default=None, help="the build tree the benchmarks came from")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/RESULTS.md"))
    parser.add_argument("--readme", type=pathlib.Path, default=None, help="README whose figures block to rewrite")
    args = parser.parse_args()
    data = load(args.results)
    if not data:
        sys.exit(f"results.py: no benchmark JSON in {args.results}")
    rows = headline(data)
    args.out.write_text(results_page(data, rows, args))
    print(f"results.py: wrote {args.out} ({len(rows)} headline figures)")
    if args.readme and rows and not smoke(data):
        update_readme(args.readme, rows)
        print(f"results.py: rewrote the figures in {args.readme}")


if __name__ == "__main__":
    main()
