"""GPU placement: what the machine has (`inventory`) and where each role instance runs (`plan`)."""
