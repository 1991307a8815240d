"""What a run shows: the live terminal view (``live``), progress lines and the end-of-run summary
(``summary``), the HTML report (``html``, its plots in ``panels``, the fleet by region in
``regions``, read through ``data``), and ``rlbus status``'s view (``status``). ``values`` holds the
helpers they share. No module here imports torch.
"""
