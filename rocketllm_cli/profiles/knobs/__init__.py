"""The knob table (declared once), each knob's formula, and resolution flag/kwarg > env > derived."""
