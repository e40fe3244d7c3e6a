"""Optional CPU acceleration: layer kernels (kernels.py), fused decoder layers (blocks.py), few-row
weight products (products.py) and the native extension they run on (native.py, csrc/)."""
