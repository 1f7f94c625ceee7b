"""The network and what it is trained to do: the ViT, the MPP targets, the objectives, backbones on disk (checkpoints, Hugging Face)."""
