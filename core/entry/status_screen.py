"""The screen of `mimpipe status` (core/entry/status.py gathers what it shows): a head line naming the run, then one
labelled line per fact, a line per checkpoint and per line the resume code prints."""

from __future__ import annotations

from core.launch.disk import describe_bytes


def render(status: dict) -> str:
    """The screen: a head line, then one labelled line per fact (a line per checkpoint)."""
    s = status
    what = f"{s['stage']}, {s['objective']} on {s['model']}" if s["model"] else s["stage"] or "stage unknown"
    recipe = f"recipe {s['lease']['recipe']}; " if s["lease"].get("recipe") else ""
    lines = [f"{s['run_dir']}  {what} ({recipe}{s['config'] or 'no config.yaml'})"]
    row = lambda label, text: lines.append(f"  {label:<12}{text}")  # noqa: E731
    row("state", _owner(s["lease"]))
    row("step", _step(s))
    if s["images_per_sec"] is not None:
        row("speed", _speed(s))
    if s["monitors"]:
        row("monitors", ", ".join(f"{k} {m['value']:.4g} (step {m['step']})" for k, m in s["monitors"].items()))
    count = len(s["checkpoints"])
    row("checkpoints", f"{count} folder{'s' * (count != 1)}, {describe_bytes(s['checkpoint_bytes'])} in checkpoints/")
    for c in s["checkpoints"]:
        why = f": {c['why']}" if c["state"] not in ("complete", "being written") else ""
        lines.append(f"  {'':<12}  {c['tag']}  {c['state']:<13} {describe_bytes(c['bytes']):>9}{why}")
    row("latest", _latest(s))
    for number, line in enumerate(_resume(s["resume"], s["latest"])):
        row("resume" if number == 0 else "", line)
    done = s["finished"]
    if done is not None:
        nothing = ": relaunching with this schedule does nothing" if done["relaunch_does_nothing"] else ""
        row("finished", f"at step {done.get('step')} ({done.get('tag')}){nothing}")
    else:
        row("finished", "no")
    row("export", _export(s["export"]))
    return "\n".join(lines)


def _owner(lease: dict) -> str:
    """Whether the run lives, after its lease (core/launch/lease.py)."""
    if lease["state"] == "none":
        return "not running (no lease)"
    if lease["state"] == "unreadable":
        return "not known: lease.json holds no lease"
    where, age = f"host {lease['host']} pid {lease['pid']}", f"{lease['heartbeat_age_s']:.0f} s ago"
    if lease["state"] == "stale":
        return f"not running: last heartbeat {age} ({where}), probably killed"
    if lease["state"] == "gone":
        return f"not running: process {lease['pid']} on this host is gone (last heartbeat {age}), probably killed"
    started = _clock(lease["started_age_s"])
    return f"running: {lease['who']}, launch {lease['owner'][:8]}; heartbeat {age}, started {started} ago"


def _step(s: dict) -> str:
    total = s["total_steps"]
    if s["step"] is None:
        reached = "none logged yet"
    else:
        reached = f"{s['step']}" + (f" / {total} ({100 * s['step'] / total:.1f}%)" if total else "")
        reached += f", last logged {_clock(s['logged_age_s'])} ago"
    return reached + ("" if total else f"; total unknown: {s['total_unknown']}")


def _speed(s: dict) -> str:
    rate = f"{s['images_per_sec']:.4g} images/s (last {s['rate_windows']} logged windows)"
    if s["eta_s"] is None:
        return rate
    if s["alive"]:
        return f"{rate}, eta {_clock(s['eta_s'])}"
    left = s["total_steps"] - s["step"]
    return f"{rate}; {left} steps left, {_clock(s['eta_s'])} at that rate" if left > 0 else rate


def _latest(s: dict) -> str:
    if s["latest"] is None:
        return "torn: names no checkpoint" if s["latest_torn"] else "none"
    state = next((c["state"] for c in s["checkpoints"] if c["tag"] == s["latest"]), "no such folder")
    return s["latest"] if state == "complete" else f"{s['latest']} ({state})"


def _resume(resume: dict, latest: str | None) -> list[str]:
    """The resume's lines: its choice, then what the resume code prints about it (without its prefix)."""
    checked = ", its files read back whole" if resume["verified"] else ""
    if resume["tag"] is None:
        head = "nothing: a relaunch starts from scratch"
    elif resume["tag"] == latest and resume["note"] is None:
        head = f"{resume['tag']} (step {resume['step']}): the one latest names, complete{checked}"
    else:
        head = f"{resume['tag']} (step {resume['step']}){checked}"
    notes = (resume["note"] or "").replace("[mimpipe] warning: ", "").splitlines()
    return [head, *notes]


def _export(export: dict | None) -> str:
    if export is None:
        return "none"
    what = export.get("method") or export.get("kind") or "?"
    what += " encoder" if export["not_exported"] else ""  # a pretraining export leaves the objective's tensors out
    if "num_params" in export:
        what += f", {export['num_params']:,} parameters in {export.get('num_tensors')} tensors"
    metrics = export.get("metrics") or {}
    score = f", val/top1 {metrics['val/top1']:.4g}" if "val/top1" in metrics else ""
    files = ", ".join(f"{name} {describe_bytes(size)}" for name, size in export.get("files", {}).items())
    return f"step {export.get('step')}: {what}{score}; {files}; written {export.get('created')}"


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
