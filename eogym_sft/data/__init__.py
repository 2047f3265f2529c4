"""Data: EO-Gym rows -> canonical conversations -> rendered, labelled, size-checked samples; images, prepared folders
and the collator."""
