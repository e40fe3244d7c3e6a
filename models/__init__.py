"""The models macspec ships: the pair catalog, the embedded default pair's draft with its model
card, and the built-in fidelity text. Installed as the package data `macspec.data`
(pyproject.toml maps this folder there), read through `macspec.models.store.DATA`."""

from pathlib import Path

DIR = Path(__file__).resolve().parent  # where the install put this folder
