"""The patch codec: one tensor's change from one weight version to the next, exactly, in few bytes.

A **patch** is one tensor's sparse change (this package); a **delta** is a version's payload of
patches (``weightstore.payload``), what the manifests and the store call a delta.

- ``codec``: ``encode_patch``, ``apply_patch``, ``patch_info``: what the streams mean;
- ``format``: the byte layout (format version 2); ``format_v1``: reading version 1 patches;
- ``context``: what the codec derives from the old weights (exponent contexts, the hot class, ...);
- ``bitcodes``: the vectorised integer codes it writes with.
"""
