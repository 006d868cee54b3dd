"""The targets `offload bench step` checks on its rows (see bench_step.py's docstring)."""

from __future__ import annotations

GiB = 1 << 30
SYSTEMS = ("offload", "offload-bf16", "offload-int8", "deepspeed")
# Targets on the nvme placement (parameters streaming).
TARGET_VS_DEEPSPEED = 0.35
TARGET_VS_BOUND = 1.10
TARGET_RSS_SLACK = 0.5 * GiB
# Targets of compressed moments on the nvme placement, against offload fp32's nvme row.
TARGET_COMPRESSED_BYTES = 0.6
TARGET_COMPRESSED_STEP = 0.7
# [Note: practicality] The no-offload step over the NVMe step, with int8 moments, on
# both placements that use the disk: nvme-opt (optimizer state on NVMe, parameters
# in memory: DeepSpeed's NVMe offload, whose own practicality on this machine class,
# 0.3, is the reference) and nvme (parameters streaming too).
TARGET_PRACTICALITY = 0.8
DISK_PLACEMENTS = ("nvme-opt", "nvme")


def targets(rows: list[dict], memory: int) -> list[dict]:
    """The targets on the nvme placement (parameters streaming), for those whose rows
    ran; `memory`: bytes of memory budgets in use (host, device on a CPU, I/O buffers)."""
    get = {(r["system"], r["placement"]): r for r in rows}
    off, ds = get.get(("offload", "nvme")), get.get(("deepspeed", "nvme"))
    out = compressed_targets(get)
    if off is None or off["median_step_s"] is None:
        return out
    if ds is not None and ds["median_step_s"] is not None:
        v = off["median_step_s"] / ds["median_step_s"]
        out.append({"target": f"offload nvme step <= {TARGET_VS_DEEPSPEED}x DeepSpeed's",
                    "value": v, "limit": TARGET_VS_DEEPSPEED, "met": v <= TARGET_VS_DEEPSPEED})
    if "step_over_bound" in off:
        v = off["step_over_bound"]
        out.append({"target": f"offload nvme step <= {TARGET_VS_BOUND}x the lower bound",
                    "value": v, "limit": TARGET_VS_BOUND, "met": v <= TARGET_VS_BOUND})
    limit = (memory + TARGET_RSS_SLACK) / GiB
    out.append({"target": "offload nvme peak RSS <= the memory budgets in use (host, device "
                "on a CPU, I/O buffers) + 0.5 GiB (GiB)",
                "value": off["peak_rss_GiB"], "limit": limit,
                "met": off["peak_rss_GiB"] <= limit})
    return out


def practicality(rows: list[dict]) -> None:
    """Adds `practicality` to each row of a system on a disk placement (nvme-opt,
    nvme): the system's fastest none step (offload fp32's, for offload's forms of
    the moments) over the row's step ([Note: practicality]); and, where the row has
    its CPU floor (`cpu_floor_s`), `practicality_cpu_limit`: that none step over the
    floor, the most practicality a step consuming the row's CPU time could reach."""
    def base(system: str) -> str:
        return "offload" if system.startswith("offload") else system
    none: dict[str, float] = {}
    for r in rows:
        if r["placement"] == "none" and r["median_step_s"] and r["system"] == base(r["system"]):
            none[r["system"]] = min(none.get(r["system"], r["median_step_s"]),
                                    r["median_step_s"])
    for r in rows:
        step = none.get(base(r["system"]))
        if r["placement"] in DISK_PLACEMENTS and r["median_step_s"] and step is not None:
            r["practicality"] = step / r["median_step_s"]
            if r.get("cpu_floor_s"):  # the most the row's CPU time allows
                r["practicality_cpu_limit"] = step / r["cpu_floor_s"]


def compressed_targets(get: dict) -> list[dict]:
    """Compressed moments on the nvme placement against offload fp32's row: bytes per
    step (read + written) and step time ratios, and the practicality."""
    out = []
    base = get.get(("offload", "nvme"))
    for placement in DISK_PLACEMENTS:
        r = get.get(("offload-int8", placement))
        if r is not None and r.get("practicality") is not None:
            v = r["practicality"]
            out.append({"target": f"offload-int8 {placement} practicality (none step / "
                        f"{placement} step) >= {TARGET_PRACTICALITY}", "value": v,
                        "limit": TARGET_PRACTICALITY, "met": v >= TARGET_PRACTICALITY})
    for system in SYSTEMS[1:3]:
        r = get.get((system, "nvme"))
        if r is None or r["median_step_s"] is None:
            continue
        if base is not None and base["median_step_s"] and base["read_bytes_per_step"]:
            v = ((r["read_bytes_per_step"] + r["write_bytes_per_step"])
                 / (base["read_bytes_per_step"] + base["write_bytes_per_step"]))
            out.append({"target": f"{system} nvme bytes per step <= "
                        f"{TARGET_COMPRESSED_BYTES}x offload fp32's", "value": v,
                        "limit": TARGET_COMPRESSED_BYTES, "met": v <= TARGET_COMPRESSED_BYTES})
            v = r["median_step_s"] / base["median_step_s"]
            out.append({"target": f"{system} nvme step <= {TARGET_COMPRESSED_STEP}x offload "
                        "fp32's", "value": v, "limit": TARGET_COMPRESSED_STEP,
                        "met": v <= TARGET_COMPRESSED_STEP})
    return out
