"""fedrun's Hydra configuration tree, shipped as package data."""
