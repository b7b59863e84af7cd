"""`kernels/sass_loops.py`: the main loop of a disassembly, counted by opcode."""

from tokenspeed.kernels.sass_loops import loops, main_loop_mix, opcode

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   FFMA R6, R7, R8, R6 ;
        /*0030*/              @!P0 BRA `(.L_x_0) ;
        /*0040*/                   EXIT ;
.L_x_1:
        /*0050*/                   BRA `(.L_x_1);
.L_x_2:
        /*0060*/                   HADD2.F32 R9, -RZ, R10.H0_H0 ;
        /*0070*/                   F2FP.F16.E4M3.UNPACK_B R11, R12 ;
        /*0080*/                   FFMA R6, R7, R8, R6 ;
        /*0090*/                   FFMA R6, R7, R8, R6 ;
        /*00a0*/               @P1 BRA `(.L_x_2) ;
"""


def test_loops_are_bodies_of_backward_branches_and_the_longest_is_counted() -> None:
    bodies = loops(LISTING)
    assert [len(b) for b in bodies] == [3, 1, 5]
    assert main_loop_mix(LISTING) == {"FFMA": 2, "HADD2": 1, "F2FP": 1, "BRA": 1}
    assert opcode("@!P0 LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]") == "LDGSTS"
    assert main_loop_mix("        /*0000*/                   EXIT ;") == {}
