"""The codecs: one reducer class per wire format. Pure torch."""

from gradsync.comm.codecs.cast import Bf16Reducer, Fp16Reducer
from gradsync.comm.codecs.int8 import Int4Reducer, Int8Reducer, QuantizedReducer
from gradsync.comm.codecs.powersgd import PowerSGDReducer
from gradsync.comm.codecs.sign import SignReducer
from gradsync.comm.codecs.sparse import SparseLoCoReducer
from gradsync.comm.codecs.topk import TopKReducer

__all__ = ["Bf16Reducer", "Fp16Reducer", "Int4Reducer", "Int8Reducer", "PowerSGDReducer", "QuantizedReducer",
           "SignReducer", "SparseLoCoReducer", "TopKReducer"]
