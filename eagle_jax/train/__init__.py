"""Draft-head training: data generation (`data`), and the trainer (`python -m eagle_jax.train`, in progress)."""
