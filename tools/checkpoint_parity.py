"""Prints the checkpoint-conversion parity table for the current Keras backend.

    for b in jax tensorflow torch; do KERAS_BACKEND=$b python tools/checkpoint_parity.py; done

Builds the same references as tests/test_convert.py (tools/reference_checkpoints.py:
a transformers Ti/16 at 224 with perturbed weights, rewritten in the timm and
big_vision/AugReg layouts; a keras-hub ViTImageClassifier), converts each, and prints the largest absolute logit difference
on two random 224x224 images. The tests assert these are below 1e-4.
"""

import os
import sys
import tempfile

import keras
import numpy as np


def main():
    import torch
    import transformers

    import reference_checkpoints as helpers
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file

    from keras_vitnorm.models import load_checkpoint

    images = np.random.default_rng(0).uniform(-1, 1, (2, 224, 224, 3)).astype("float32")
    work = tempfile.mkdtemp()
    # Every reference's initial weights are seeded too, so the table is reproducible.
    torch.manual_seed(0)
    keras.utils.set_random_seed(1)
    hf = helpers.perturbed(transformers.ViTForImageClassification(transformers.ViTConfig(**helpers.TI)), 0)
    hf.save_pretrained(os.path.join(work, "hf"))
    with torch.no_grad():
        expected = hf(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2))).logits.numpy()
    state = load_file(os.path.join(work, "hf", "model.safetensors"))
    save_file(helpers.to_timm(state), os.path.join(work, "timm.safetensors"))
    np.savez(os.path.join(work, "augreg.npz"), **helpers.to_big_vision(state, "augreg"))
    sources = [("Hugging Face directory", os.path.join(work, "hf"), expected),
               ("timm .safetensors", os.path.join(work, "timm.safetensors"), expected),
               ("AugReg .npz", os.path.join(work, "augreg.npz"), expected)]
    try:
        import keras_hub

        backbone = keras_hub.models.ViTBackbone(
            image_shape=(224, 224, 3), patch_size=16, num_layers=12, num_heads=3, hidden_dim=192,
            mlp_dim=768)
        classifier = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=10)
        rng = np.random.default_rng(1)
        for variable in classifier.weights:
            variable.assign(keras.ops.convert_to_numpy(variable) + 0.05 * rng.standard_normal(variable.shape))
        classifier.save_to_preset(os.path.join(work, "hub"))
        sources.append(("keras-hub preset", os.path.join(work, "hub"),
                        keras.ops.convert_to_numpy(classifier(images))))
    except ImportError:
        print("keras-hub not installed: its row is left out", file=sys.stderr)
    print("| format | backend | max abs logit difference |\n|---|---|---|")
    for name, path, reference in sources:
        model, _ = load_checkpoint(path)
        error = np.max(np.abs(keras.ops.convert_to_numpy(model(images)) - reference))
        print(f"| {name} | {keras.backend.backend()} | {error:.1e} |")


if __name__ == "__main__":
    main()
