"""How the suite is ordered for pytest-xdist's two workers (pyproject.toml's addopts); nothing else."""


def pytest_collection_modifyitems(items):
    """The tests marked minigsm_base go first. Their model ships with the repository (models/), so none builds it
    today; if it had to be built (a changed default, models/ moved aside: ~15-20 min on two busy cores), first in the
    collection they fall in the first worker's first batch (xdist's load scheduling hands each worker a run of
    consecutive tests), which builds it while the other worker takes the rest of the suite. Collected in file order
    they would start late and be the suite's tail, or a second worker would wait on the build's lock."""
    items.sort(key=lambda item: item.get_closest_marker("minigsm_base") is None)  # stable: the rest keep their order
