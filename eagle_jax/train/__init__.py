"""Draft-head training: the data pipeline (`data`), target features (`features`), losses (`losses`), the
trainer with orbax checkpoints (`trainer`), and the recipe CLI (`python -m eagle_jax.train --recipe ...`)."""
