//! The `Auth` service: `Authenticate` gives a token (leasecore's users and passwords, the
//! same token `/v1` issues), which etcd clients then send with every call (`etcdctl --user`).
//!
//! # What is not here yet
//! Managing users, roles and the auth switch through etcd's API: those RPCs answer
//! `Unimplemented` at once, pointing at `leasecore user|role|auth` and `/v1/auth/...`
//! (etcd's key-range permissions map onto leasecore's, but the mapping is not written yet).
//!
//! # What it must not do
//! Check a password itself: the auth runtime does, as for `/v1/auth/authenticate`.

use leasecore_etcd_api::etcdserverpb::auth_server::Auth;
use leasecore_etcd_api::etcdserverpb::{
    AuthDisableRequest, AuthDisableResponse, AuthEnableRequest, AuthEnableResponse,
    AuthRoleAddRequest, AuthRoleAddResponse, AuthRoleDeleteRequest, AuthRoleDeleteResponse,
    AuthRoleGetRequest, AuthRoleGetResponse, AuthRoleGrantPermissionRequest,
    AuthRoleGrantPermissionResponse, AuthRoleListRequest, AuthRoleListResponse,
    AuthRoleRevokePermissionRequest, AuthRoleRevokePermissionResponse, AuthUserAddRequest,
    AuthUserAddResponse, AuthUserChangePasswordRequest, AuthUserChangePasswordResponse,
    AuthUserDeleteRequest, AuthUserDeleteResponse, AuthUserGetRequest, AuthUserGetResponse,
    AuthUserGrantRoleRequest, AuthUserGrantRoleResponse, AuthUserListRequest, AuthUserListResponse,
    AuthUserRevokeRoleRequest, AuthUserRevokeRoleResponse, AuthenticateRequest,
    AuthenticateResponse,
};
use tonic::{Request, Response, Status};

use super::{Etcd, EtcdError};

fn later(rpc: &str) -> Status {
    Status::unimplemented(format!(
        "leasecore: Auth.{rpc} is not implemented on the etcd API yet; use `leasecore user`, `role` or `auth`, or /v1/auth"
    ))
}

#[tonic::async_trait]
impl Auth for Etcd {
    async fn authenticate(
        &self,
        req: Request<AuthenticateRequest>,
    ) -> Result<Response<AuthenticateResponse>, Status> {
        let r = req.into_inner();
        let state = &self.state;
        // Linearizable, as `/v1`: a user added before this call is seen on any node.
        state
            .consensus
            .read_barrier()
            .await
            .map_err(EtcdError::from)?;
        let (token, _) = state
            .auth
            .authenticate(&r.name, &r.password)
            .await
            .map_err(|e| match e {
                // etcd's answer to a wrong name or password (clients match it).
                crate::runtime::auth::AccessError::Unauthenticated(_) => {
                    EtcdError::Status(Status::invalid_argument(
                        "etcdserver: authentication failed, invalid user ID or password",
                    ))
                }
                other => EtcdError::from(other),
            })?;
        Ok(Response::new(AuthenticateResponse {
            header: self.header(),
            token,
        }))
    }

    async fn auth_enable(
        &self,
        _req: Request<AuthEnableRequest>,
    ) -> Result<Response<AuthEnableResponse>, Status> {
        Err(later("AuthEnable"))
    }

    async fn auth_disable(
        &self,
        _req: Request<AuthDisableRequest>,
    ) -> Result<Response<AuthDisableResponse>, Status> {
        Err(later("AuthDisable"))
    }

    async fn user_add(
        &self,
        _req: Request<AuthUserAddRequest>,
    ) -> Result<Response<AuthUserAddResponse>, Status> {
        Err(later("UserAdd"))
    }

    async fn user_get(
        &self,
        _req: Request<AuthUserGetRequest>,
    ) -> Result<Response<AuthUserGetResponse>, Status> {
        Err(later("UserGet"))
    }

    async fn user_list(
        &self,
        _req: Request<AuthUserListRequest>,
    ) -> Result<Response<AuthUserListResponse>, Status> {
        Err(later("UserList"))
    }

    async fn user_delete(
        &self,
        _req: Request<AuthUserDeleteRequest>,
    ) -> Result<Response<AuthUserDeleteResponse>, Status> {
        Err(later("UserDelete"))
    }

    async fn user_change_password(
        &self,
        _req: Request<AuthUserChangePasswordRequest>,
    ) -> Result<Response<AuthUserChangePasswordResponse>, Status> {
        Err(later("UserChangePassword"))
    }

    async fn user_grant_role(
        &self,
        _req: Request<AuthUserGrantRoleRequest>,
    ) -> Result<Response<AuthUserGrantRoleResponse>, Status> {
        Err(later("UserGrantRole"))
    }

    async fn user_revoke_role(
        &self,
        _req: Request<AuthUserRevokeRoleRequest>,
    ) -> Result<Response<AuthUserRevokeRoleResponse>, Status> {
        Err(later("UserRevokeRole"))
    }

    async fn role_add(
        &self,
        _req: Request<AuthRoleAddRequest>,
    ) -> Result<Response<AuthRoleAddResponse>, Status> {
        Err(later("RoleAdd"))
    }

    async fn role_get(
        &self,
        _req: Request<AuthRoleGetRequest>,
    ) -> Result<Response<AuthRoleGetResponse>, Status> {
        Err(later("RoleGet"))
    }

    async fn role_list(
        &self,
        _req: Request<AuthRoleListRequest>,
    ) -> Result<Response<AuthRoleListResponse>, Status> {
        Err(later("RoleList"))
    }

    async fn role_delete(
        &self,
        _req: Request<AuthRoleDeleteRequest>,
    ) -> Result<Response<AuthRoleDeleteResponse>, Status> {
        Err(later("RoleDelete"))
    }

    async fn role_grant_permission(
        &self,
        _req: Request<AuthRoleGrantPermissionRequest>,
    ) -> Result<Response<AuthRoleGrantPermissionResponse>, Status> {
        Err(later("RoleGrantPermission"))
    }

    async fn role_revoke_permission(
        &self,
        _req: Request<AuthRoleRevokePermissionRequest>,
    ) -> Result<Response<AuthRoleRevokePermissionResponse>, Status> {
        Err(later("RoleRevokePermission"))
    }
}
