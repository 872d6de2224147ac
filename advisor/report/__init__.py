"""Text renderers: they draw summaries the library computed (rich tables, fitted to the terminal)."""
