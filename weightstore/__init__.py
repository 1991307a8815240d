"""Weights over object storage: backends, the sparse-delta codec, publication and following.

Submodules are imported explicitly (``from weightstore.publish import WeightPublisher``) so that
importing the package stays cheap and does not pull in torch.
"""
