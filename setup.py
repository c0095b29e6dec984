"""The packages of the distribution: one import namespace, ``compress``, over sibling folders.

Each folder below maps into ``compress`` (``quantizers/`` is ``compress.quantizers``), and every
folder with an ``__init__.py`` under them is a package, found by setuptools' ``find_packages``; so a
new package folder (a format's ``export/<name>/``) needs no entry here. pyproject.toml holds the rest
of the configuration: its declarative ``packages.find`` cannot put a found folder under another
package's name, which is why this file exists.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {
    "compress": "compress",
    "compress.quantizers": "quantizers",
    "compress.pruning": "pruning",
    "compress.distill": "distill",
    "compress.export": "export",
    "compress.eval": "eval",
}


def packages() -> list[str]:
    """Every package: each mapped folder and the folders with an __init__.py under it, by import name."""
    return [name for package, folder in PACKAGE_DIRS.items() for name in (package, *(f"{package}.{sub}" for sub in find_packages(folder)))]


if __name__ == "__main__":
    setup(packages=packages(), package_dir=PACKAGE_DIRS)
