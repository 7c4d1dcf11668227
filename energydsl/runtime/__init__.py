"""What generated code runs on: causal reductions and attention forms (`ops`), initialisers (`init`), and
the language-model runtime that composes energy modules (`model`)."""
