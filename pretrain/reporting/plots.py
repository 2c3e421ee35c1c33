"""The curriculum plot: loss, LM loss, indexer KL, LR and sequence length against consumed
tokens, one shaded band per stage; with validation, a panel of the validation LM loss per data
category (``valid_lm_loss/<category>``). Written atomically (a reader never sees half a PNG)."""

from __future__ import annotations

import os

PANELS = (("loss", "loss"), ("lm_loss", "LM loss"), ("indexer_kl", "indexer KL"), ("lr", "LR"),
          ("seq_length", "sequence length"))
LOSSES = ("loss", "lm_loss")


def plot_curriculum(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    categories = sorted({k.split("/", 1)[1] for r in history for k in r if k.startswith("valid_lm_loss/")})
    panels = PANELS + ((("valid_lm_loss/", "validation LM loss\nper category"),) if categories else ())
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.1 * len(panels)), sharex=True)
    bands, start = [], 0
    for i, r in enumerate(history):
        if i == 0 or r["stage"] != history[i - 1]["stage"]:
            bands.append([r["stage"], start, r["consumed_tokens"]])
        bands[-1][2] = r["consumed_tokens"]
        start = r["consumed_tokens"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label) in zip(axes, panels):
        if key == "valid_lm_loss/":
            for j, c in enumerate(categories):
                pts = [r for r in history if key + c in r]
                ax.plot([r["consumed_tokens"] for r in pts], [r[key + c] for r in pts], "o-", ms=3, lw=0.8,
                        color=colors[j % len(colors)], label=c)
            ax.legend(loc="best", fontsize=7, ncol=min(4, len(categories)))
        else:  # a step whose global batch had no loss token (e.g. all tool output) has no loss to plot
            keep = [r for r in history if key in r and (key not in LOSSES or r.get("loss_tokens", 1) > 0)]
            ax.plot([r["consumed_tokens"] for r in keep], [r[key] for r in keep], lw=1.2, color="black")
        if key == "lm_loss":
            valid = [r for r in history if "valid_lm_loss" in r]
            ax.plot([r["consumed_tokens"] for r in valid], [r["valid_lm_loss"] for r in valid], "o",
                    ms=4, color="tab:red", label="validation")
            if valid:
                ax.legend(loc="upper right", fontsize=7)
        ax.set_ylabel(label)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        for j, (name, lo, hi) in enumerate(bands):
            ax.axvspan(lo, hi, color=colors[j % len(colors)], alpha=0.15, lw=0)
    for j, (name, lo, hi) in enumerate(bands):
        axes[0].text((lo + hi) / 2, 1.02, name, transform=axes[0].get_xaxis_transform(),
                     ha="center", va="bottom", fontsize=7, rotation=20)
    axes[-1].set_xlabel("consumed tokens")
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
