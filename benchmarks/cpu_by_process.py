"""Run a command and report the CPU seconds every process on the machine used meanwhile.

    gridserve bench cpu-by-process --output-json out.json -- CMD ARGS...

Reads utime + stime from /proc/<pid>/stat before and after (Linux); the command's own share (it
has exited by then) comes from the children's rusage: e.g. where the cores go while a ``bench serve``
load runs against a server: the worker's forward passes against the gateway, Envoy, the engine and
the load generator. ``bench peer`` uses :func:`cpu_used` around its served runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds so far) for every process we can read."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if not cmdline:  # a kernel thread: its name
                with open(f"/proc/{name}/comm") as f:
                    cmdline = f"[{f.read().strip()}]"
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[int(name)] = (cmdline, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
             min_seconds: float = 0.0) -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds used between two :func:`cpu_seconds` snapshots), for the
    processes alive at ``after`` that used at least ``min_seconds`` (one born meanwhile: all of it)."""
    out = {}
    for pid, (cmdline, cpu) in after.items():
        used = cpu - before.get(pid, (cmdline, 0.0))[1]
        if used >= min_seconds:
            out[pid] = (cmdline, used)
    return out


def role(cmdline: str) -> str:
    """A short name: the gridserve role, envoy, or the command's first words."""
    words = cmdline.split()
    if "gridserve.cli" in words:
        rest = words[words.index("gridserve.cli") + 1:]
        return " ".join(rest[:2]) if rest[:1] == ["bench"] else (rest[0] if rest else "gridserve")
    if words and words[0].endswith("/envoy"):
        return "envoy"
    return " ".join(os.path.basename(w) for w in words[:2]) or "?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", "--json", dest="output_json", default=None,
                        help="also write the table here")
    parser.add_argument("--min-seconds", type=float, default=0.5)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...: the command to run")


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("bench cpu-by-process: give the command to run after --")
    before, start = cpu_seconds(), time.monotonic()
    rc = subprocess.call(command)
    after, wall = cpu_seconds(), time.monotonic() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = [{"process": "this command (" + role(" ".join(command)) + ")",
             "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}]
    for pid, (cmdline, used) in cpu_used(before, after, args.min_seconds).items():
        if pid != os.getpid():
            rows.append({"process": f"{role(cmdline)} (pid {pid})", "cpu_s": round(used, 1)})
    rows.sort(key=lambda r: -r["cpu_s"])
    cores = os.cpu_count() or 1
    print(f"\nCPU seconds while it ran: {wall:.1f} s wall x {cores} cores = {wall * cores:.0f} core-seconds")
    for r in rows:
        r["share_of_machine"] = round(r["cpu_s"] / (wall * cores), 3)
        print(f"  {r['cpu_s']:8.1f} s  {100 * r['share_of_machine']:5.1f}%  {r['process']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"wall_s": round(wall, 1), "cores": cores, "processes": rows}, f, indent=2)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
