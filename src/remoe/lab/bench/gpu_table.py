"""The GPU rows (:func:`remoe.lab.bench.gpu.train_row`) as text, for ``remoe bench --suite gpu``
and ``scripts/gpu_check.sh``: a row's stage name and label, the markdown table docs/SCALING.md
publishes, each ReLU row against its TopK row."""

from __future__ import annotations


def row_name(row: dict) -> str:
    """A gpu-check row's stage name: ``relu_compiled_inductor_capacity_mb16x4_fused_chunk4096``
    (``row``: router, backend, plan, capture_dynamic, micro_batch, grad_accum, adamw,
    loss_chunk)."""
    name = row["router"] + (f"_compiled_{row['backend']}" if row["backend"] else "_eager")
    if row["router"] != "dense":
        name += f"_{row['plan']}" + ("_captured" if row["capture_dynamic"] else "")
    name += f"_mb{row['micro_batch']}x{row['grad_accum']}"
    if row["adamw"] != "auto":
        name += f"_{row['adamw']}"
    if row["loss_chunk"]:
        name += f"_chunk{row['loss_chunk']}"
    for option in row.get("step_options", ()):
        name += f"_{option}"
    return name


def _row_label(r: dict) -> str:
    name = r["router"] + (", compiled" if r.get("compiled") else "")
    if r["router"] != "dense" and r.get("plan", "exact") != "exact":
        name += f", {r['plan']} plan"
    if r.get("capture_dynamic"):
        name += ", nonzero captured"
    if r.get("adamw", "auto") != "auto":
        name += f", {r['adamw']} AdamW"
    if r.get("loss_chunk"):
        name += f", loss chunk {r['loss_chunk']}"
    for option in r.get("step_options", ()):
        name += f", {option.replace('_', ' ')}"
    return name


def table(res: dict) -> str:
    """The markdown table docs/SCALING.md publishes, then ReLU against TopK at the same micro
    batch, accumulation and compile setting: tokens/s and per active (token, expert) pair."""
    head = ("| device | preset | row | mb x accum | tokens/s | pairs/token | MFU (data sheet) | "
            "MFU (matmul) | peak GiB | syncs/step (fwd/bwd/step) |")
    lines = [head, "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in res["rows"]:
        lines.append(f"| {r['device']} | {r['preset']} | {_row_label(r)} | "
                     f"{r['micro_batch']} x {r.get('grad_accum', 1)} | {r['tokens_per_s']:,.0f} | "
                     f"{f(r.get('pairs_per_token'), '.3f')} | {f(r['mfu'], '.1%')} | "
                     f"{f(r['mfu_vs_matmul'], '.1%')} | {f(r['peak_mem_gib'], '.1f')} | "
                     f"{r['syncs_per_step']} ({r['syncs_forward']}/{r['syncs_backward']}/"
                     f"{r['syncs_step']}) |")
    ratios = relu_vs_topk(res["rows"])
    if ratios:
        lines += ["", "| ReLU row | vs TopK row | tokens/s ratio | per active pair | pairs/token "
                  "ReLU / TopK |", "|---|---|---:|---:|---:|"]
        for q in ratios:
            lines.append(f"| {q['relu']} | {q['topk']} | {q['tokens_ratio']:.3f} | "
                         f"{q['pair_ratio']:.3f} | {q['pairs_relu']:.3f} / {q['pairs_topk']:.3f} |")
    fe = res.get("fsdp_ep")
    if fe is None:
        lines.append("\nFSDP+EP, 2 processes: not run (fewer than 2 GPUs)")
    elif "error" in fe:
        lines.append(f"\nFSDP+EP, 2 processes: FAILED: {fe['error']}")
    else:
        lines.append(f"\nFSDP+EP, 2 processes (micro model, NCCL): {fe['tokens_per_s']:,.0f} "
                     f"tokens/s")
    return "\n".join(lines)


def relu_vs_topk(rows: list[dict]) -> list[dict]:
    """Each ReLU row against the TopK row of the same micro batch, accumulation, compile
    setting, AdamW, loss chunk and step options (the defaults when no TopK row has the same
    options): the tokens/s ratio and the ratio of (token, expert) pairs per second, which holds
    the comparison at equal work when the pairs per token differ."""
    def key(r, full=True):
        base = (r["micro_batch"], r.get("grad_accum", 1), r.get("compiled"))
        return base + ((r.get("adamw", "auto"), r.get("loss_chunk", 0),
                        tuple(r.get("step_options", ()))) if full else ())

    topk = {key(r): r for r in rows if r["router"] == "topk"}
    plain = {key(r, False): r for r in rows if r["router"] == "topk"
             and r.get("adamw", "auto") == "auto" and not r.get("loss_chunk")
             and not r.get("step_options")}
    out = []
    for r in rows:
        if r["router"] != "relu":
            continue
        t = topk.get(key(r)) or plain.get(key(r, False))
        if t is None or not r.get("pairs_per_token") or not t.get("pairs_per_token"):
            continue
        tok = r["tokens_per_s"] / t["tokens_per_s"]
        out.append({"relu": _row_label(r), "topk": _row_label(t), "tokens_ratio": tok,
                    "pair_ratio": tok * r["pairs_per_token"] / t["pairs_per_token"],
                    "pairs_relu": r["pairs_per_token"], "pairs_topk": t["pairs_per_token"],
                    "micro_batch": r["micro_batch"], "grad_accum": r.get("grad_accum", 1)})
    return out
