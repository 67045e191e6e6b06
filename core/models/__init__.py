"""The encoders a recipe names: timm's ViT and hybrid (`vit`), T2T-ViT (`t2t_vit`), VT-ResNet (`vt`), registered with
timm (`registry`), built from the recipe by `build`; fixed sin-cos position embeddings (`pos_embed`). Nothing
distributed lives here."""
