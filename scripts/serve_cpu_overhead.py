"""The serve benchmark with the engine on a thread of the server and in a process of its own, side by side.

    python scripts/serve_cpu_overhead.py [--num-prompts 50 --input-len 128 --output-len 64] [server flags]

Runs `nanoserve bench serve --launch` twice on the same workload, without and with --engine-process, and
prints the two summaries' main figures in a table, then one JSON line. Flags the benchmark does not know
go to both servers (e.g. --model DIR --load-format dummy). On the CPU the bundled tiny model makes each
step cheap, so the figures show the host's work (HTTP, streaming, scheduling, detokenizing) more than
the model's: the part the engine process takes off the server's GIL.
"""

import json
import sys

from nanoserve.bench import serve

FIGURES = ["request_throughput", "output_throughput", "p50_ttft_ms", "p50_tpot_ms", "p50_itl_ms", "p99_itl_ms"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {"--num-prompts": "50", "--input-len": "128", "--output-len": "64"}
    for flag, value in defaults.items():
        if flag not in argv:
            argv += [flag, value]
    runs = {}
    for backend, flags in (("thread", ["--no-engine-process"]), ("process", ["--engine-process"])):
        print(f"--- engine on a {backend}", file=sys.stderr)
        runs[backend] = serve.run(["--launch", "--no-progress", *argv, *flags])
    print(f"{'':22}{'thread':>12}{'process':>12}", file=sys.stderr)
    for name in FIGURES:
        print(f"{name:22}{runs['thread'][name]:>12}{runs['process'][name]:>12}", file=sys.stderr)
    print(json.dumps({"benchmark": "serve_cpu_overhead", "args": argv,
                      **{backend: {name: s[name] for name in FIGURES + ["completed", "failed"]}
                         for backend, s in runs.items()}}), flush=True)
    return 0 if all(s["failed"] == 0 for s in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
