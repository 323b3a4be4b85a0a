"""What every course plot shares: the axes it draws into and how it ends (labels, grid, legend).
matplotlib loads only when a figure is drawn."""


def axes(ax, figsize=(6.4, 4.0), **grid):
    """`ax`, or new axes (`grid`: plt.subplots options such as nrows, sharex)."""
    import matplotlib.pyplot as plt

    return plt.subplots(**grid, figsize=figsize, layout="constrained")[1] if ax is None else ax


def finish(ax, grid: dict | None = None, legend: dict | None = None, **settings):
    """`ax.set(**settings)` (labels, limits, title), a light grid and a legend; returns ax."""
    ax.set(**settings)
    ax.grid(alpha=0.3, **(grid or {}))
    ax.legend(**(legend or {}))
    return ax
