"""Data: EO-Gym rows -> canonical conversations -> rendered, labelled, size-checked samples; images and prepared folders."""
