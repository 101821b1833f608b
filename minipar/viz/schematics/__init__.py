"""Schematic figures, drawn before the measurements: each from the objects the trainer
itself runs (the ring's chunk order, the tensor-parallel layers' shards, ZeRO's
partitions, a schedule's action lists, the collectives each layout calls), so a picture
cannot drift from the code it explains. One module per idea: `ring`, `tensor`, `zero`,
`pipeline`, `layer`; each gives its picture as data (`*_picture`) and draws it with
matplotlib (`draw_*`, `plot_*`)."""
