"""``tjax plan``'s answer for a person: a few lines (fits, memory, step time, MFU, what bounds
the step, the costliest operations) where ``--json`` gives every figure."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def _step_lines(name: str, step: dict[str, Any] | None) -> list[str]:
    if step is None:
        return []
    memory, line = step["memory"], step["roofline"]
    fits = "fits" if memory["fits"] else "does NOT fit"
    head = f"{name}: mesh {step.get('mesh', '?')}"
    if "remat" in step:
        head += f", remat {step['remat']}"
    if "total_bytes" not in memory:  # the compiler refused it for lack of memory
        return [f"{head}: does NOT fit ({memory.get('compiler', 'refused by the compiler')})"]
    lines = [f"{head}: {fits}, {memory['total_bytes'] / GIB:.2f} of "
             f"{memory['hbm_bytes'] / GIB:.2f} GiB per device"]
    if line:
        split = ", ".join(f"{k} {v:.3g} s" for k, v in line["split"].items() if v)
        lines += [f"  step {line['step_s']:.4g} s ({split}), bound by {line['bound']}; "
                  f"MFU {100 * line['mfu']:.1f}%, {step['tokens_per_s']:,.0f} tokens/s",
                  "  costliest operations: " + ", ".join(
                      f"{op['name']} {op['est_s']:.3g} s" for op in line["top_ops"][:3])]
    return lines


def summary(result: dict[str, Any]) -> str:
    """The lines printed without ``--json``."""
    target = result["target"]
    train = result.get("train")
    lines = [f"{target['name']} ({target['chips']} x {target['chip']}): "
             f"batch {result['batch_size']} x {result['seq_len']} tokens"
             + (f", {train['params'] / 1e6:,.1f}M parameters" if train else "")]
    if train is None:
        lines.append(f"train: {result.get('train_note', 'no plan')}")
    lines += _step_lines("train", train)
    if result.get("context"):
        lines.append(f"  across the context axis: {result['context']['cheaper']} is cheaper")
    lines += _step_lines("decode", result.get("decode"))
    lines.append("(compiler figures and a datasheet roofline: estimates, not measured runs; "
                 "--json prints every figure)")
    return "\n".join(lines)
