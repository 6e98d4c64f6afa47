"""Striping: one epoch's batches from several servers at once, handed out in plan order.

Reading order: `policy.py` (`StripePolicy`, every tuning number), `states.py` (server states and
cancel reasons, with the transition table), `model.py` (a server, its pace, a request in flight),
`schedule.py` (`Schedule`: every decision, pure; `actions.py`: what it answers), `worker.py` (a
request slot: runs what the schedule decides over the link), `receiver.py` (`StripedReceiver`:
the threads, the hand-out in plan order).
"""

from gdsload.service.client.stripe.policy import StripePolicy
from gdsload.service.client.stripe.states import CancelReason, ServerState

__all__ = ["CancelReason", "ServerState", "StripePolicy"]
