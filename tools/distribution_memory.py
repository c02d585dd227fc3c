"""Memory per device of a ViT's weights and AdamW state, data-parallel against FSDP (JAX).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 KERAS_BACKEND=jax \\
        python tools/distribution_memory.py --presets b16 l16 --layouts data fsdp

Builds each preset (1000 classes) and an AdamW optimizer inside the layout's
distribution scope (keras_vitnorm.training.distribution), then prints, per device, the
bytes computed from the layout (parameters, AdamW's two moments, float32) and the
bytes measured: the sum over every model and optimizer variable of its shard on the
first device. Activations come on top; they split over the batch in both layouts.
"""

import argparse
import re

import keras
import numpy as np

from keras_vitnorm import ViT
from keras_vitnorm.training.distribution import FSDP_LAYOUT
from keras_vitnorm.training.distribution import distribution_scope

GIB = 2**30


def computed_bytes(model, layout, devices):
    """Parameters plus AdamW's two moments, float32, of what one device holds."""
    total = 0
    for variable in model.trainable_weights:
        size = int(np.prod(variable.shape))
        sharded = layout == "fsdp" and any(re.fullmatch(p, variable.path) for p in FSDP_LAYOUT)
        total += 3 * 4 * (size // devices if sharded else size)
    return total


def measured_bytes(variables, device):
    total = 0
    for variable in variables:
        for shard in variable.value.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["b16", "l16"])
    parser.add_argument("--layouts", nargs="+", choices=("data", "fsdp"), default=["data", "fsdp"])
    args = parser.parse_args()
    import jax

    devices = jax.devices()
    print(f"{len(devices)} {devices[0].platform} devices\n")
    print("| preset | parameters | layout | per device, computed | per device, measured |")
    print("|---|---|---|---|---|")
    for preset in args.presets:
        for layout in args.layouts:
            scope, _ = distribution_scope(layout)
            with scope:
                model = ViT.from_preset(preset, num_classes=1000)
                optimizer = keras.optimizers.AdamW(1e-3)
                optimizer.build(model.trainable_variables)
            measured = measured_bytes([*model.weights, *optimizer.variables], devices[0])
            computed = computed_bytes(model, layout, len(devices))
            print(f"| {preset} | {model.count_params() / 1e6:.1f}M | {layout} | "
                  f"{computed / GIB:.2f} GiB | {measured / GIB:.2f} GiB |")
            del model, optimizer


if __name__ == "__main__":
    main()
