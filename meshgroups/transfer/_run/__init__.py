"""Private: meshgroups/transfer/_run. See the package front."""
