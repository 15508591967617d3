"""A per-request token timeline: one row per request, a tick per streamed chunk, long
prompts in another colour, so prefill stalls show up as gaps across every stream."""

from __future__ import annotations

from baton.loadgen.stats import RequestRecord


def plot_timeline(records: list[RequestRecord], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in records if r.success), key=lambda r: r.start)
    fig, ax = plt.subplots(figsize=(12, max(3.0, min(12.0, 0.12 * len(rows) + 2))))
    for row, r in enumerate(rows):
        long = r.kind == "long"
        color = "tab:red" if long else "tab:blue"
        ax.hlines(row, r.start, r.start + (r.e2e or 0), color=color, alpha=0.25, linewidth=1)
        if r.ttft is not None:  # the wait for the first token
            ax.hlines(row, r.start, r.start + r.ttft, color="tab:orange" if not long else "darkred", linewidth=2)
        ax.plot([r.start + t for t in r.chunk_times], [row] * len(r.chunk_times), "|",
                color=color, markersize=3, alpha=0.8)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("request")
    ax.set_title(title or "token timeline (ticks: streamed tokens; thick: waiting for the first token; red: long prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
