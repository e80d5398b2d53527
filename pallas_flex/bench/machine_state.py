"""The state of the machine a benchmark ran on: GPU clocks, power and temperature from
`nvidia-smi`, and the host's load, recorded before and after each suite.

A result file's times mean little without it: the same code has timed 1.5-1.7x slower on
one H100 host than on another (docs/gpu-notes.md, Paged and ragged), and a GPU held
below its maximum clock, at its power limit or hot, or a host whose CPUs are busy (every
kernel launch is dispatched from Python), is told apart from a slower kernel only by
these figures."""

from __future__ import annotations

import os
import shutil
import subprocess

# nvidia-smi's names; the throttle reasons were renamed "event reasons" (drivers 535+),
# so each name is tried in turn and the query made without it where neither exists.
_FIELDS = ("index", "name", "driver_version", "pstate", "clocks.sm", "clocks.max.sm",
           "clocks.mem", "clocks.max.mem", "power.draw", "power.limit", "temperature.gpu",
           "utilization.gpu")
_TEXT = ("name", "driver_version", "pstate")  # kept as text ("570.86" is no number)
_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active", None)


def _query(executable, fields):
    """[{field: value}] per GPU, or None where nvidia-smi refused the query."""
    try:
        result = subprocess.run(
            [executable, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    gpus = []
    for line in result.stdout.strip().splitlines():
        values = [value.strip() for value in line.split(",")]
        if len(values) != len(fields):
            return None
        gpus.append({field: value if field in _TEXT else _number(value)
                     for field, value in zip(fields, values)})
    return gpus


def _number(value: str):
    """nvidia-smi's value as a number where it is one ("1980" -> 1980, "312.5" -> 312.5);
    the text otherwise ("P0", "[N/A]", a hex bit mask)."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def gpus(executable: str | None = None) -> list[dict]:
    """Per GPU: index, name, driver, performance state, SM and memory clocks (now and
    their maxima, MHz), power draw and limit (W), temperature (C), utilization (%) and the
    active clock-event (throttle) reasons as nvidia-smi's bit mask; [] without
    nvidia-smi or where it fails."""
    executable = executable or shutil.which("nvidia-smi")
    if executable is None:
        return []
    for reasons in _REASONS:
        fields = _FIELDS + ((reasons,) if reasons else ())
        found = _query(executable, fields)
        if found is not None:
            if reasons:
                for gpu in found:
                    gpu["clock_event_reasons"] = gpu.pop(reasons)
            return found
    return []


def snapshot(executable: str | None = None) -> dict:
    """{gpus (above), load_average (1, 5, 15 minutes), cpus}: the machine now."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not every platform has it
        load = None
    return {"gpus": gpus(executable), "load_average": load, "cpus": os.cpu_count()}
