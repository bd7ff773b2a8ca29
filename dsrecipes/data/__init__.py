"""The data layer: reading, checking, rendering and tokenizing conversations; planning and loading them."""
