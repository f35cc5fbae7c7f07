"""Tools beside the product, never imported by the training core: the GPU check, the report of finished runs
and its plots, the offline sweep runner, the configuration-reference generator."""
