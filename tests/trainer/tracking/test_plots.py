"""The comparison plots read as a user expects: a bar per run when each run validated once or twice (not one dot
per run), plain-number ticks (never "1.4x10^1"), a log axis only across a decade or more."""

from memlm.trainer.tracking.plots import draw_curves


def _tick_texts(fig):
    fig.canvas.draw()
    ax = fig.axes[0]
    return ax, [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels() +
                ax.get_yminorticklabels()]


def test_one_point_per_run_is_a_bar_per_run_named_by_the_runs():
    curves = {"demo-transformer": [(40, 14.2)], "demo-txl": [(40, 13.1)], "demo-lamemo": [(20, 13.5), (40, 12.9)]}
    fig = draw_curves(curves, ylabel="validation perplexity", title="t", log_y=True)
    ax, texts = _tick_texts(fig)
    assert [t.get_text() for t in ax.get_xticklabels()] == list(curves)
    assert [round(p.get_height(), 6) for p in ax.patches] == [14.2, 13.1, 12.9]  # the latest value of each run
    assert not any("10^" in t or "times" in t or "$" in t for t in texts), texts


def test_curves_within_a_decade_stay_linear_with_plain_ticks():
    curves = {"a": [(10, 14.2), (20, 13.0), (30, 12.5)], "b": [(10, 15.0), (20, 14.0), (30, 13.9)]}
    ax, texts = _tick_texts(draw_curves(curves, ylabel="v", title="t", log_y=True))
    assert ax.get_yscale() == "linear" and len(ax.get_lines()) == 2
    assert not any("$" in t for t in texts), texts


def test_curves_across_decades_use_a_log_axis_with_plain_ticks():
    curves = {"a": [(10, 900.0), (20, 120.0), (30, 30.0)], "b": [(10, 800.0), (20, 60.0), (30, 8.0)]}
    ax, texts = _tick_texts(draw_curves(curves, ylabel="v", title="t", log_y=True))
    assert ax.get_yscale() == "log"
    labelled = [t for t in (x.get_text() for x in ax.get_yticklabels()) if t]
    assert labelled and all(t.replace(".", "").isdigit() for t in labelled), labelled


def test_no_points_draws_nothing():
    assert draw_curves({"a": []}, ylabel="v", title="t") is None
